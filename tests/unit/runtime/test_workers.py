"""Tests for daemon.runtime.workers: reused threads, batched completions, context, cancel."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from typing import Any

import anyio
import pytest

from daemon.core.statements import Step
from daemon.runtime.steps import StepRun, run_step
from daemon.runtime.workers import Workers
from tests.helpers.wait import until

_var: contextvars.ContextVar[str] = contextvars.ContextVar("test_var", default="unset")


class TestWorkers:
    async def test_sequential_jobs_reuse_one_thread(self) -> None:
        """A thread that finishes a job takes the next; none is started per call."""
        workers = Workers()
        try:
            names = [await workers.run(lambda: threading.current_thread().name) for _ in range(50)]
            assert workers.threads == 1
            assert set(names) == {"workflowd-step"}
            assert threading.current_thread().name not in names
        finally:
            workers.close()
        await until(lambda: workers.threads == 0, limit_s=5)

    async def test_a_lone_job_arms_no_check(self) -> None:
        """A job that a thread was woken for arms no loop timer: an idle pool does not poll."""
        workers = Workers()
        loop = asyncio.get_running_loop()
        real, checks = loop.call_later, []

        def counted(delay: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
            if getattr(callback, "__self__", None) is workers:
                checks.append(delay)
            return real(delay, callback, *args, **kw)

        loop.call_later = counted  # type: ignore[method-assign,assignment]
        try:
            for _ in range(20):
                await workers.run(lambda: None)
        finally:
            del loop.call_later
            workers.close()
        assert checks == []

    async def test_jobs_that_do_not_block_share_a_thread(self) -> None:
        """Many quick jobs in flight at once wake few threads, not one each."""
        workers = Workers()
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(workers.run, lambda: None)
            # One would do; a few more may wake where a job waited long for the GIL.
            assert workers.threads <= 10
        finally:
            workers.close()

    async def test_grows_while_jobs_block(self) -> None:
        """Jobs that block at once each get a thread of their own, and all run together."""
        workers = Workers()
        barrier = threading.Barrier(4, timeout=10)
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(workers.run, barrier.wait)
            assert workers.threads == 4
        finally:
            workers.close()

    async def test_results_errors_and_context(self) -> None:
        """A job sees the caller's context vars; its value or its exception comes back."""
        workers = Workers()
        _var.set("caller")
        try:
            assert await workers.run(_var.get) == "caller"

            def boom() -> None:
                raise KeyError("k")

            with pytest.raises(KeyError):
                await workers.run(boom)
        finally:
            workers.close()

    async def test_cancelled_caller_drops_the_result(self) -> None:
        """Cancelling the caller stops the wait; the thread finishes and takes later jobs."""
        workers = Workers()
        release = threading.Event()
        try:
            with anyio.move_on_after(0.05):
                await workers.run(lambda: release.wait(10))
            release.set()
            assert await workers.run(lambda: 7) == 7
        finally:
            workers.close()

    def test_loops_that_closed_leave_no_descriptors_behind(self) -> None:
        """Each loop gets a wake-up pipe; it is closed once that loop has closed."""
        workers = Workers()

        async def one() -> int:
            result: int = await workers.run(lambda: 7)
            return result

        try:
            assert asyncio.run(one()) == 7
            before = len(os.listdir("/proc/self/fd"))
            for _ in range(20):
                assert asyncio.run(one()) == 7
            # The last loop's pipe is closed only when a next loop comes: at most its two.
            assert len(os.listdir("/proc/self/fd")) <= before
        finally:
            workers.close()


class TestInlineSteps:
    async def test_inline_sync_step_runs_on_the_loop(self) -> None:
        """`Step(..., inline=True)` runs its sync action on the loop thread, with no slot."""
        seen: list[str] = []
        limiter = anyio.CapacityLimiter(1)
        step = Step("quick", lambda: seen.append(threading.current_thread().name), inline=True)
        async with limiter:  # every slot taken: an inline step does not need one
            await run_step(step, limiter=limiter, note=lambda *_: None, run=StepRun("quick"))
        assert seen == [threading.current_thread().name]
