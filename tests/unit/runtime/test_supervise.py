"""The supervisor of background tasks: a failure is logged and retried with backoff, never fatal."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import structlog

from daemon.runtime.supervise import supervise
from tests.helpers.wait import until


class Script:
    """A round's work that raises on the rounds listed in `fail_on`, and counts every call."""

    def __init__(self, *fail_on: int) -> None:
        self.fail_on, self.calls, self.pauses = set(fail_on), 0, 0

    async def work(self) -> None:
        self.calls += 1
        if self.calls in self.fail_on:
            raise OSError(f"round {self.calls} broke")

    async def pause(self) -> None:
        self.pauses += 1
        await anyio.lowlevel.checkpoint()


def events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [r for r in logs if r["event"] == name]


class TestSupervise:
    async def test_failures_are_logged_and_retried_with_backoff(self) -> None:
        """Two failures in a row wait 0.01 then 0.02 s; the next success logs the recovery."""
        script = Script(1, 2)
        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: supervise("demo", script.work, script.pause, initial_s=0.01))
                await until(lambda: script.pauses >= 2)
                tg.cancel_scope.cancel()
        failed = events(logs, "task_failed")
        assert [(r["task"], r["failures"], r["retry_in_s"]) for r in failed] == [
            ("demo", 1, 0.01),
            ("demo", 2, 0.02),
        ]
        assert failed[0]["error"] == "OSError: round 1 broke"
        assert [(r["task"], r["failures"]) for r in events(logs, "task_recovered")] == [("demo", 2)]
        assert script.pauses >= 2  # no pause after a failure: the backoff replaces it

    async def test_backoff_is_capped_and_starts_over(self) -> None:
        """The delay stops at max_s; after a success the next failure waits initial_s again."""
        script = Script(1, 2, 3, 5)
        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: supervise("demo", script.work, script.pause, initial_s=0.01, max_s=0.02)
                )
                await until(lambda: script.calls >= 6)
                tg.cancel_scope.cancel()
        delays = [r["retry_in_s"] for r in events(logs, "task_failed")]
        assert delays == [0.01, 0.02, 0.02, 0.01]

    async def test_a_failing_pause_is_retried_too(self) -> None:
        """A pause that raises is a failure like any other."""
        calls = 0

        async def pause() -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("pause broke")
            await anyio.lowlevel.checkpoint()

        async def work() -> None:
            await anyio.lowlevel.checkpoint()

        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: supervise("demo", work, pause, initial_s=0.01))
                await until(lambda: calls >= 3)
                tg.cancel_scope.cancel()
        assert [r["error"] for r in events(logs, "task_failed")] == ["RuntimeError: pause broke"]

    async def test_cancellation_ends_it(self) -> None:
        """Cancelling the task stops it: a cancellation is not a failure to retry."""
        script = Script()
        with structlog.testing.capture_logs() as logs, anyio.move_on_after(0.05):
            await supervise("demo", script.work, script.pause)
        assert script.calls > 0 and events(logs, "task_failed") == []

    async def test_base_exceptions_are_not_swallowed(self) -> None:
        """A KeyboardInterrupt or SystemExit inside a round still ends the task."""

        async def work() -> None:
            raise SystemExit(3)

        with pytest.raises(SystemExit):
            await supervise("demo", work, work)
