"""Tests for systemd/: the units pass `systemd-analyze verify` without warnings."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parent.parent / "systemd"
ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def verify(tmp_path: Path, service: str, socket: str) -> subprocess.CompletedProcess[str]:
    """Run `systemd-analyze verify` on copies of the units.

    ExecStart and ExecReload point at the installed venv, which does not exist on a development
    machine, and verify fails on a missing binary; the copy runs /bin/true instead. Nothing else
    is changed.
    """
    lines = [
        line.partition("=")[0] + "=/bin/true"
        if line.startswith(("ExecStart=", "ExecReload="))
        else line
        for line in service.splitlines()
    ]
    (tmp_path / "workflowd.service").write_text("\n".join(lines) + "\n")
    (tmp_path / "workflowd.socket").write_text(socket)
    return subprocess.run(
        [ANALYZE or "", "verify", "--man=no", "workflowd.service", "workflowd.socket"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def complaints(result: subprocess.CompletedProcess[str]) -> list[str]:
    """Return the output lines that are about our units."""
    output = result.stdout + result.stderr
    return [line for line in output.splitlines() if "workflowd" in line]


def units() -> tuple[str, str]:
    return (UNITS / "workflowd.service").read_text(), (UNITS / "workflowd.socket").read_text()


class TestVerify:
    def test_units_verify_cleanly(self, tmp_path: Path) -> None:
        """Both units pass verify with no warning about unknown or unparsable directives."""
        result = verify(tmp_path, *units())
        assert complaints(result) == []
        assert result.returncode == 0, result.stderr

    def test_verify_catches_a_bad_directive(self, tmp_path: Path) -> None:
        """A misspelt directive or value is reported, so the clean result above means something."""
        service, socket = units()
        service = service.replace("KillMode=mixed", "KillMode=mixd")
        socket = socket.replace("[Install]", "[Install]\nWantedByy=sockets.target")
        found = "\n".join(complaints(verify(tmp_path, service, socket)))
        assert "KillMode" in found or "mixd" in found
        assert "WantedByy" in found


class TestContents:
    def parse(self, name: str) -> configparser.ConfigParser:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str  # type: ignore[assignment, method-assign]
        parser.read(UNITS / name)
        return parser

    def test_service_settings(self) -> None:
        """The service is Type=notify with a watchdog, a fixed user and its own directories."""
        service = self.parse("workflowd.service")["Service"]
        assert service["Type"] == "notify"
        assert service["NotifyAccess"] == "main"
        assert service["User"] == service["Group"] == "workflowd"
        assert service["StateDirectory"] == service["RuntimeDirectory"] == "workflowd"
        assert service["RuntimeDirectoryPreserve"] == "yes"
        assert service["WatchdogSec"] == "30"
        # The reload is synchronous and fails when refused; the socket is where the daemon listens.
        assert service["ExecReload"].endswith(" --socket /run/workflowd/workflowd.sock reload")
        assert service["CapabilityBoundingSet"] == ""
        assert "DynamicUser" not in service

    def test_socket_matches_example_config(self) -> None:
        """The socket unit listens where systemd/config.toml tells the daemon to bind."""
        sock = self.parse("workflowd.socket")["Socket"]
        assert sock["ListenStream"] == "/run/workflowd/workflowd.sock"
        assert sock["SocketMode"] == "0660"
        assert sock["Service"] == "workflowd.service"
        assert '"$RUNTIME_DIRECTORY/workflowd.sock"' in (UNITS / "config.toml").read_text()


class TestBackupTimer:
    """systemd/workflowd-backup.{service,timer}: the nightly backup, by name into backup_dir."""

    def test_backup_units_verify_cleanly(self, tmp_path: Path) -> None:
        """The backup service and timer pass verify beside the daemon's own units."""
        verify(tmp_path, *units())  # writes the daemon's units (with /bin/true) into tmp_path
        for name in ("workflowd-backup.service", "workflowd-backup.timer"):
            shutil.copyfile(UNITS / name, tmp_path / name)
        names = ["workflowd-backup.service", "workflowd-backup.timer"]
        result = subprocess.run(
            [ANALYZE or "", "verify", "--man=no", *names],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert complaints(result) == []
        assert result.returncode == 0, result.stderr

    def test_backup_names_a_file(self) -> None:
        """The backup asks for a name (the daemon picks the folder), never a path."""
        text = (UNITS / "workflowd-backup.service").read_text()
        (exec_start,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
        assert ' backup "nightly-$$(date +%%F)"' in exec_start
        timer = (UNITS / "workflowd-backup.timer").read_text()
        assert "OnCalendar=" in timer and "WantedBy=timers.target" in timer
