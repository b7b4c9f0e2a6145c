"""Tests for daemon.runtime.commands: exit codes, output caps, stdin, env, kills."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon.core.command import Run
from daemon.core.statements import NonRetryableError
from daemon.runtime.commands import CommandFailed, CommandTimeout, group_alive, run_command
from tests.helpers.wait import until


class Notes:
    """Collects the history entries a command run records."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, detail: dict[str, Any]) -> None:
        self.entries.append((kind, detail))

    def only(self) -> dict[str, Any]:
        """Return the one `command_run` record."""
        ((kind, detail),) = self.entries
        assert kind == "command_run"
        return detail


class TestRunCommand:
    async def test_stdin_env_and_callable_argv(self) -> None:
        """argv is built when the step runs; stdin is fed; env is added to the daemon's."""
        code = "import os, sys; print(sys.stdin.read().upper(), os.environ['WHO'], 'PATH' in os.environ)"
        parts = [sys.executable]
        run = Run("r", lambda: [*parts, "-c", code], stdin="hi", env={"WHO": "ann"})
        notes = Notes()
        done = await run_command(run, note=notes)
        assert done == {"exit_code": 0, "stdout": "HI ann True\n", "stderr": ""}
        assert notes.only()["outcome"] == "exited"

    async def test_large_stdin_and_output_stream_through(self) -> None:
        """Megabytes in and out pass the pipes whole, the command's ends blocking as usual."""
        code = "import sys; data = sys.stdin.buffer.read(); sys.stdout.buffer.write(data * 2)"
        run = Run("r", [sys.executable, "-c", code], stdin=b"y" * 3_000_000, output_max_bytes=4)
        notes = Notes()
        done = await run_command(run, note=notes)
        assert done["exit_code"] == 0 and done["stderr"] == ""
        assert notes.only()["stdout_bytes"] == 6_000_000

    async def test_ok_codes_and_failure(self) -> None:
        """An exit code in ok_codes passes; another fails with the last stderr line."""
        ok = Run("r", ["sh", "-c", "exit 2"], ok_codes=(0, 2))
        assert (await run_command(ok, note=Notes()))["exit_code"] == 2
        bad = Run("r", ["sh", "-c", "echo one >&2; echo two >&2; exit 1"])
        with pytest.raises(CommandFailed, match="exited with code 1: two"):
            await run_command(bad, note=Notes())

    async def test_output_keeps_the_tail(self) -> None:
        """Only the last output_max_bytes are kept; the total is counted."""
        run = Run("r", [sys.executable, "-c", "print('x' * 5000 + 'end')"], output_max_bytes=10)
        notes = Notes()
        done = await run_command(run, note=notes)
        assert done["stdout"] == "xxxxxxend\n"
        assert notes.only()["stdout_bytes"] == 5004

    async def test_timeout_terms_then_kills(self, tmp_path: Path) -> None:
        """Past the timeout the group gets SIGTERM, then SIGKILL after the grace."""
        pid = tmp_path / "pid"
        run = Run("r", ["sh", "-c", f"trap '' TERM; echo $$ > {pid}; sleep 30 & wait"], timeout=0.2)
        notes = Notes()
        with pytest.raises(CommandTimeout, match="ran over its timeout"):
            await run_command(run, note=notes, kill_after_s=0.3)
        assert notes.only()["outcome"] == "timeout"
        assert not group_alive(int(pid.read_text()))

    async def test_cancel_ends_the_group(self, tmp_path: Path) -> None:
        """A cancelled step's command and what it started are gone when the cancel returns."""
        pid = tmp_path / "pid"
        run = Run("r", ["sh", "-c", f"echo $$ > {pid}; sleep 30 & wait"])
        notes = Notes()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_command(run, note=notes))
            await until(lambda: pid.exists() and pid.read_text().strip() != "")
            tg.cancel_scope.cancel()
        assert notes.only()["outcome"] == "cancelled"
        assert not group_alive(int(pid.read_text()))

    async def test_straggler_is_ended_after_the_leader_exits(self, tmp_path: Path) -> None:
        """What a command leaves in its group when it exits does not outlive the step."""
        pid = tmp_path / "pid"
        run = Run("r", ["sh", "-c", f"echo $$ > {pid}; sleep 30 > /dev/null 2>&1 &"])
        assert (await run_command(run, note=Notes()))["exit_code"] == 0
        assert not group_alive(int(pid.read_text()))

    async def test_bad_argv_fails_at_once(self) -> None:
        """An argv built from the data that is not a list of strings fails the workflow."""
        with pytest.raises(NonRetryableError, match="list of strings"):
            await run_command(Run("r", lambda: ["echo", 3]), note=Notes())  # type: ignore[list-item]

    def test_bad_arguments_are_refused_when_built(self) -> None:
        """A Run with a bad argv, timeout or ok_codes fails when the definition is built."""
        with pytest.raises(TypeError):
            Run("r", "echo hi")
        with pytest.raises(ValueError, match="timeout"):
            Run("r", ["true"], timeout=0)
        with pytest.raises(ValueError, match="ok_codes"):
            Run("r", ["true"], ok_codes=())
