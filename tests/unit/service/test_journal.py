"""Tests for daemon.service.journal: the native journald protocol, to a real datagram socket."""

from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path

import pytest
import structlog

from daemon.service import journal
from daemon.service.log import configure_logging


def journal_fields(datagram: bytes) -> dict[str, str]:
    """Parse a native journal message made only of KEY=value lines."""
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


@pytest.mark.usefixtures("restore_logging")
class TestJournal:
    def test_attached_only_to_the_named_stream(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """$JOURNAL_STREAM must name stdout's own device and inode."""
        with (tmp_path / "out").open("w") as out:
            st = os.fstat(out.fileno())
            monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
            assert journal.attached(out)
            monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
            assert not journal.attached(out)
        assert not journal.attached(io.StringIO())

    def test_records_carry_native_fields(self, tmp_path: Path) -> None:
        """Each record goes to journald as its JSON line plus WORKFLOW_ID=, STEP=, PRIORITY=."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(tmp_path / "journal.sock"))
            sock.settimeout(5)
            out = io.StringIO()
            configure_logging(
                "info", "json", out, cache=False, journal=str(tmp_path / "journal.sock")
            )
            structlog.get_logger().warning("step_slow", workflow_id="w1", step="s1")
            fields = journal_fields(sock.recv(65536))
            assert fields["STEP"] == "s1" and fields["EVENT"] == "step_slow"
            assert fields["PRIORITY"] == "4" and fields["SYSLOG_IDENTIFIER"] == "workflowd"
            assert fields["WORKFLOW_ID"] == "w1" and json.loads(fields["MESSAGE"])["step"] == "s1"
            assert out.getvalue() == ""
            structlog.get_logger().info("huge", blob="x" * 4_000_000)  # over any datagram
            assert json.loads(out.getvalue())["event"] == "huge"  # so it went to stdout

    def test_newline_in_a_field_is_length_prefixed(self) -> None:
        """A value with a newline uses the binary form, so it cannot forge another field."""
        data = journal.encode({"WORKFLOW_ID": "a\nPRIORITY=0"})
        assert data == b"WORKFLOW_ID\n" + (12).to_bytes(8, "little") + b"a\nPRIORITY=0\n"
