"""Tests for daemon.runtime.pool: steps of several threads in flight, retries, stopping."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import pytest

from daemon import Go, S, Section, State, Step, WaitFor, Workflow, WorkflowStatus, resume
from daemon.clock import FakeClock
from daemon.core.merge import fork
from daemon.core.state import CheckpointType
from daemon.errors import StepFailed
from daemon.runtime.pool import StepPool
from daemon.runtime.settings import Settings
from tests.helpers.wait import until


@dataclass
class Pair(Workflow):
    """Two threads: `a` fails `fail_a` times first, `b` waits for `b_go` (an anyio.Event)."""

    fail_a: int = 0
    tries: int = 0
    got: list[str] = field(default_factory=list)

    async def a(self, gate: anyio.Event, tries: list[int]) -> None:
        tries.append(1)
        if len(tries) <= self.fail_a:
            self.got.append("lost")  # discarded with the failed attempt
            raise RuntimeError(f"attempt {len(tries)}")
        self.got.append("a")
        gate.set()

    async def b(self, gate: anyio.Event) -> None:
        await gate.wait()
        self.got.append("b")

    def definition(self) -> Section:
        gate, tries = _shared(self)
        return S(
            Go("ta", Step("a", partial(self.a, gate, tries))),
            Go("tb", Step("b", partial(self.b, gate))),
            WaitFor("both", len(self.got) == 2),
        )


_SHARED: dict[int, tuple[anyio.Event, list[int]]] = {}


def _shared(wf: Pair) -> tuple[anyio.Event, list[int]]:
    # One gate per test run (keyed by the fail count, which each test sets differently).
    return _SHARED.setdefault(wf.fail_a, (anyio.Event(), []))


class Run:
    """Drives one `resume` with a StepPool on a fake clock, recording retries and notes."""

    def __init__(self, wf: Workflow, clock: FakeClock) -> None:
        self.wf, self.clock = wf, clock
        self.state = State.new("p", type(wf).name)
        self.retries: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.saves: list[CheckpointType] = []
        self.pool: StepPool | None = None

    async def checkpoint(self, kind: CheckpointType) -> None:
        self.saves.append(kind)

    async def on_retry(self, detail: dict[str, Any], attempt: int, error: str, due: float) -> None:
        self.retries.append(detail)

    def note(self, kind: str, detail: dict[str, Any]) -> None:
        self.notes.append(kind)

    async def resume(self, settings: Settings) -> None:
        async with StepPool(
            limiter=anyio.CapacityLimiter(4),
            clock=self.clock,
            settings=settings,
            note=self.note,
            on_retry=self.on_retry,
        ) as self.pool:
            await resume(self.wf, self.state, self.checkpoint, steps=self.pool)


class TestPool:
    async def test_steps_of_two_threads_overlap(self) -> None:
        """`b` waits for `a`'s gate: run one after the other, they would never finish."""
        _SHARED.clear()
        run = Run(Pair(), FakeClock())
        with anyio.fail_after(10):
            await run.resume(Settings())
        assert run.state.status is WorkflowStatus.FINISHED
        assert isinstance(run.wf, Pair) and run.wf.got == ["a", "b"]
        assert run.notes.count("step_done") == 2

    async def test_a_retry_waits_in_its_thread(self) -> None:
        """A failing step is retried on a fresh copy after its backoff; the other step still
        waits meanwhile, and the failed attempts' changes are gone."""
        _SHARED.clear()
        clock = FakeClock()
        run = Run(Pair(fail_a=2), clock)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.resume, Settings(retry_initial_s=5))
            with anyio.fail_after(10):
                await until(lambda: len(run.retries) >= 1)
                clock.advance(5)
                await until(lambda: len(run.retries) >= 2)
                clock.advance(10)
        assert [r["attempt"] for r in run.retries] == [1, 2]
        assert [r["retry_in_s"] for r in run.retries] == [5, 10]
        assert isinstance(run.wf, Pair) and run.wf.got == ["a", "b"]

    async def test_failure_for_good_cancels_the_others(self) -> None:
        """After its last attempt, a step's failure leaves `resume` and cancels the waiting step."""
        _SHARED.clear()
        run = Run(Pair(fail_a=5), FakeClock())
        with anyio.fail_after(10), pytest.raises(StepFailed, match="attempt 1"):
            await run.resume(Settings(retry_max_attempts=1))
        assert isinstance(run.wf, Pair) and run.wf.got == []
        assert run.notes == ["step_failed"]

    async def test_stopping_ends_retry_waits(self) -> None:
        """A stop (shutdown) ends a retry wait at once: `resume` returns, the thread still
        at its step, to run again after the restart."""
        clock = FakeClock()
        run = Run(Broken(), clock)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.resume, Settings(retry_initial_s=60))
            with anyio.fail_after(10):
                await until(lambda: bool(run.retries))
                assert run.pool is not None and run.pool.resting
                run.pool.stop()
        thread = run.state.thread("_main_")
        assert thread is not None and (thread.status, thread.cur_step) == ("Executing", "f")
        assert run.state.status is WorkflowStatus.RESUMING


@dataclass
class Broken(Workflow):
    """One step that always fails."""

    def f(self) -> None:
        raise RuntimeError("broken")

    def definition(self) -> Section:
        return S(Step("f", self.f))


class TestStoppedPool:
    async def test_steps_started_after_a_stop_do_not_run(self) -> None:
        """Steps the engine started before it saw the stop are reported not run."""
        ran: list[str] = []
        async with StepPool(
            limiter=anyio.CapacityLimiter(4),
            clock=FakeClock(),
            settings=Settings(),
            note=lambda kind, detail: None,
            on_retry=_no_retry,
        ) as pool:
            wf = Broken()
            step = Step("f", lambda: ran.append("f"))
            pool.start("a", partial(fork, wf, step))
            pool.start("b", partial(fork, wf, step))
            pool.stop()
            with anyio.fail_after(5):
                done = await pool.next()
        assert [(d.thread_id, d.fork, d.failure) for d in done] == [
            ("a", None, None),
            ("b", None, None),
        ]
        assert ran == []


async def _no_retry(detail: dict[str, Any], attempt: int, error: str, due: float) -> None:
    raise AssertionError("no retry expected")
