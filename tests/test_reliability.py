"""Durability under abuse: SIGKILLs under load, disk full, locks, corrupt rows, broken handlers."""

from __future__ import annotations

from pathlib import Path

from tests.torture import Plan, torture


class TestCrashTorture:
    """SIGKILL at random moments while workflows run, signals arrive and timers fire."""

    async def test_five_kills_lose_nothing(self, tmp_path: Path) -> None:
        """After 5 kills and a graceful restart, everything matches a crash-free run."""
        report = await torture(tmp_path, Plan(seed=7, kills=5, graceful_every=4))
        assert report.problems == []
        assert report.kills == 5 and report.graceful >= 1
        assert report.acked_sends > 0 and report.steps > 0
