"""Tests for daemon.runtime.steps: worker slots, timeouts and abandoned threads."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from daemon.core.statements import Step
from daemon.runtime.steps import Abandoned, StepRun, run_step
from tests.helpers.wait import until


class Notes:
    """Collects the history entries a step run records."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, detail: dict[str, Any]) -> None:
        self.entries.append((kind, detail))

    def kinds(self) -> list[str]:
        """Return the kinds recorded, in order."""
        return [kind for kind, _ in self.entries]


class TestSyncSteps:
    async def test_past_its_timeout_the_slot_is_freed(self) -> None:
        """A hung sync step fails at its timeout, frees its slot and is counted as abandoned."""
        release = threading.Event()
        limiter, notes, abandoned = anyio.CapacityLimiter(1), Notes(), Abandoned()
        hung = Step("hung", lambda: release.wait(30), timeout=0.2)
        try:
            with pytest.raises(TimeoutError, match="its thread was abandoned"):
                await run_step(hung, limiter=limiter, note=notes, abandoned=abandoned)
            assert limiter.borrowed_tokens == 0
            assert (abandoned.total, abandoned.running) == (1, 1)
            # The next step gets the slot while the abandoned thread still runs.
            ran: list[bool] = []
            with anyio.fail_after(10):
                await run_step(Step("next", lambda: ran.append(True)), limiter=limiter, note=notes)
            assert ran == [True]
        finally:
            release.set()
        await until(lambda: abandoned.running == 0)
        assert abandoned.total == 1
        assert notes.entries[0] == (
            "step_abandoned",
            {"step": "hung", "reason": "timeout", "timeout_s": 0.2},
        )
        assert notes.kinds()[1:] == ["step_done"]

    async def test_a_step_in_time_is_not_abandoned(self) -> None:
        """A sync step that ends within its timeout is just done."""
        notes, abandoned = Notes(), Abandoned()
        step = Step("quick", lambda: None, timeout=30)
        await run_step(step, limiter=anyio.CapacityLimiter(1), note=notes, abandoned=abandoned)
        assert notes.kinds() == ["step_done"] and abandoned.total == 0

    async def test_an_action_raising_timeout_error_is_its_own_failure(self) -> None:
        """A TimeoutError raised by the action itself abandons nothing."""

        def times_out() -> None:
            raise TimeoutError("the remote end did not answer")

        abandoned = Abandoned()
        with pytest.raises(TimeoutError, match="remote end"):
            await run_step(
                Step("t", times_out, timeout=30),
                limiter=anyio.CapacityLimiter(1),
                note=Notes(),
                abandoned=abandoned,
            )
        assert abandoned.total == 0

    async def test_cancel_abandons_the_thread(self) -> None:
        """Cancelling a running sync step (shutdown, `cancel`) frees its slot at once."""
        release = threading.Event()
        limiter, notes, abandoned = anyio.CapacityLimiter(1), Notes(), Abandoned()
        run = StepRun("hung")
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: run_step(
                        Step("hung", lambda: release.wait(30)),
                        limiter=limiter,
                        note=notes,
                        run=run,
                        abandoned=abandoned,
                    )
                )
                await until(lambda: run.running_since is not None)
                tg.cancel_scope.cancel()
            assert limiter.borrowed_tokens == 0 and abandoned.running == 1
        finally:
            release.set()
        assert notes.entries == [
            ("step_abandoned", {"step": "hung", "reason": "cancelled", "timeout_s": None})
        ]


class TestShown:
    @staticmethod
    async def hold(run: StepRun, limiter: anyio.CapacityLimiter, release: threading.Event) -> None:
        """Run a sync step named after `run` that blocks until `release` is set."""
        await run_step(
            Step(run.step, lambda: release.wait(30)), limiter=limiter, note=Notes(), run=run
        )

    async def test_queued_then_running(self) -> None:
        """A step waiting for the only slot shows `queued_since`, then `running_since`."""
        release = threading.Event()
        limiter = anyio.CapacityLimiter(1)
        holder, waiter = StepRun("holder"), StepRun("waiter")
        began = time.time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.hold, holder, limiter, release)
            await until(lambda: holder.running_since is not None)
            tg.start_soon(self.hold, waiter, limiter, release)
            await until(lambda: waiter.queued_since is not None)
            shown = waiter.shown()
            assert set(shown) == {"step", "for_s", "queued_since"}
            assert began <= shown["queued_since"] <= time.time()
            assert set(holder.shown()) == {"step", "for_s", "running_since"}
            release.set()
            await until(lambda: waiter.running_since is not None)
        assert "queued_since" not in waiter.shown()
        assert waiter.running_since is not None and waiter.running_since >= shown["queued_since"]

    async def test_async_step_runs_at_once(self) -> None:
        """An async step needs no slot: it shows `running_since` from the start."""
        run = StepRun("a")

        async def action() -> None:
            assert "running_since" in run.shown()

        await run_step(Step("a", action), limiter=anyio.CapacityLimiter(1), note=Notes(), run=run)
