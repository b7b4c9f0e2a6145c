"""Tests for daemon.runtime.deadlines, on a fake clock."""

from __future__ import annotations

import anyio

from daemon.clock import FakeClock
from daemon.runtime.deadlines import DEADLINE_PASSED, Deadlines
from tests.helpers.wait import until


class TestDeadlines:
    async def test_each_is_cancelled_when_its_deadline_passes(self) -> None:
        """Workflows are cancelled in deadline order, with error `deadline passed`."""
        clock, expired = FakeClock(), []

        async def expire(wid: str, error: str) -> None:
            expired.append((wid, error))

        async with anyio.create_task_group() as tg:
            deadlines = Deadlines(tg, clock, expire)
            tg.start_soon(deadlines.run)
            deadlines.add("late", clock.now() + 20)
            deadlines.add("soon", clock.now() + 10)
            await anyio.wait_all_tasks_blocked()
            assert expired == []
            clock.advance(10)
            await until(lambda: expired == [("soon", DEADLINE_PASSED)])
            clock.advance(10)
            await until(lambda: len(expired) == 2)
            assert expired[1] == ("late", DEADLINE_PASSED)
            tg.cancel_scope.cancel()

    async def test_a_failed_cancel_is_tried_again(self) -> None:
        """A cancel that fails (the store is down) is tried again 5 s later."""
        clock, calls = FakeClock(), []

        async def expire(wid: str, error: str) -> None:
            calls.append(wid)
            if len(calls) == 1:
                raise OSError("disk I/O error")

        async with anyio.create_task_group() as tg:
            deadlines = Deadlines(tg, clock, expire)
            tg.start_soon(deadlines.run)
            deadlines.add("w", clock.now() + 1)
            clock.advance(1)
            await until(lambda: calls == ["w"])
            await anyio.wait_all_tasks_blocked()
            clock.advance(5)
            await until(lambda: calls == ["w", "w"])
            tg.cancel_scope.cancel()
