"""Tests for daemon.service.logwriter: what the writer thread renders off the loop."""

from __future__ import annotations

import datetime

import pytest

from daemon.service.logwriter import iso_time


class TestIsoTime:
    @pytest.mark.parametrize(
        "stamp",
        [1764607292.0, 1764607292.999999, 1764607292.9999999, 1764607292.000001, 0.25, 1e9 + 5e-7],
    )
    def test_timestamp_as_timestamper_writes_it(self, stamp: float) -> None:
        """The writer renders the call's time as TimeStamper(fmt="iso", utc=True) would."""
        when = datetime.datetime.fromtimestamp(stamp, datetime.UTC)
        assert iso_time(stamp) == when.isoformat().replace("+00:00", "Z")
