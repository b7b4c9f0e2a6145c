"""Tests for daemon.runtime.pool: steps of several threads in flight, retries, stopping."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import anyio
import pytest

from daemon import For, Go, S, Section, State, Step, WaitFor, Workflow, WorkflowStatus, resume
from daemon.clock import FakeClock
from daemon.core.merge import fork
from daemon.core.state import CheckpointType
from daemon.errors import RunawayWorkflow, StepFailed
from daemon.runtime.pool import StepPool
from daemon.runtime.settings import Settings
from daemon.runtime.steps import ABANDONED
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

    def options(self) -> dict[str, Any]:
        """Return the pool's further keyword arguments (none: the defaults)."""
        return {}

    async def resume(self, settings: Settings) -> None:
        async with StepPool(
            limiter=anyio.CapacityLimiter(4),
            clock=self.clock,
            settings=settings,
            note=self.note,
            on_retry=self.on_retry,
            **self.options(),
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


@dataclass
class Counter(Workflow):
    """Runs `n` sync steps; step `fail_at` fails once; step `block_at` waits for `gate`."""

    n: int = 10
    i: int = 0
    fail_at: int = -1
    block_at: int = -1
    failed: bool = False
    delay_s: float = 0.0

    def inc(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.i == self.fail_at and not _FAILED.get(id(self)):
            _FAILED[id(self)] = True
            self.i = -100  # undone with the failed attempt
            raise RuntimeError("once")
        if self.i == self.block_at:
            _GATE.entered.set()
            _GATE.open.wait(10)
        _THREADS.append(threading.get_ident())
        self.i += 1

    def definition(self) -> Section:
        return S(For("loop", self.i < self.n, Step("inc", self.inc)))


class _Gate:
    def __init__(self) -> None:
        self.entered, self.open = threading.Event(), threading.Event()


_GATE = _Gate()
_FAILED: dict[int, bool] = {}
_THREADS: list[int] = []


class Chained(Run):
    """Drives `resume` with a pool that chains, recording each checkpoint's data and count."""

    def __init__(self, wf: Workflow, clock: FakeClock, room: int, chain_s: float = 60.0) -> None:
        super().__init__(wf, clock)
        self.room, self.chain_s = room, chain_s
        #: (kind, wf.i, checkpoints it stands for) for each checkpoint, the pool's own too.
        self.taken: list[tuple[str, int, int]] = []
        #: (step, outcome) of each attempt, as the pool observed it.
        self.observed: list[tuple[str, str]] = []

    def take(self, kind: str) -> None:
        assert self.pool is not None
        wf = self.wf
        done = wf.i if isinstance(wf, Counter | AsyncCounter) else len(cast(Named | Mixed, wf).ran)
        self.taken.append((kind, done, 1 + self.pool.take_chained()))

    async def checkpoint(self, kind: CheckpointType) -> None:
        self.saves.append(kind)
        if kind in (CheckpointType.AFTER_STEP, CheckpointType.STEPS_STARTED):
            self.take(kind.value)

    async def save(self) -> None:
        self.take("pool")

    def observe(self, step: str, outcome: str, seconds: float) -> None:
        assert seconds >= 0
        self.observed.append((step, outcome))

    def options(self) -> dict[str, Any]:
        return {
            "room": lambda: self.room,
            "save": self.save,
            "chain_s": self.chain_s,
            "observe": self.observe,
        }


class TestChain:
    async def test_sync_steps_run_back_to_back_in_one_worker_thread(self) -> None:
        """A lone thread's sync steps are not handed back one by one: a checkpoint stands for
        each run of them, as many as the pipeline has room for, and each is noted done."""
        _THREADS.clear()
        run = Chained(Counter(n=100), FakeClock(), room=31)
        with anyio.fail_after(10):
            await run.resume(Settings())
        assert run.state.status is WorkflowStatus.FINISHED
        assert isinstance(run.wf, Counter) and run.wf.i == 100
        assert run.notes.count("step_done") == 100
        assert len(set(_THREADS)) == 1 and _THREADS[0] != threading.get_ident()
        steps = [(i, count) for kind, i, count in run.taken if kind == "afterStep"]
        assert len(steps) < 10
        # Each checkpoint stands for the steps since the one before, at most 32 of them.
        before = 0
        for i, count in steps:
            assert 0 < i - before == count <= 32
            before = i
        assert before == 100

    async def test_a_slow_step_ends_the_chain(self) -> None:
        """Past the chain's time budget a step is handed back, to be checkpointed at once:
        a slow step's checkpoint never waits for the steps after it."""
        run = Chained(Counter(n=5, delay_s=0.002), FakeClock(), room=31, chain_s=0.001)
        with anyio.fail_after(10):
            await run.resume(Settings())
        counts = [count for kind, _, count in run.taken if kind == "afterStep"]
        assert counts == [1, 1, 1, 1, 1]

    async def test_room_bounds_a_chain(self) -> None:
        """With room for 2 more checkpoints, no checkpoint stands for more than 3 steps."""
        run = Chained(Counter(n=10), FakeClock(), room=2)
        with anyio.fail_after(10):
            await run.resume(Settings())
        counts = [count for kind, _, count in run.taken if kind == "afterStep"]
        assert sum(counts) == 10 and max(counts) == 3

    async def test_a_chained_step_that_fails_is_retried_after_a_checkpoint(self) -> None:
        """The steps before the failing one are checkpointed before its failure is stored;
        its changes are undone, and its retry (attempt 1 of its own) goes on from there."""
        _FAILED.clear()
        clock = FakeClock()
        run = Chained(Counter(n=10, fail_at=4), clock, room=31)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.resume, Settings(retry_initial_s=5))
            with anyio.fail_after(10):
                await until(lambda: len(run.retries) >= 1)
                assert run.taken[-1] == ("pool", 4, 4)
                clock.advance(5)
        assert [r["attempt"] for r in run.retries] == [1]
        assert isinstance(run.wf, Counter) and run.wf.i == 10
        assert run.notes.count("step_done") == 10
        assert sum(count for kind, _, count in run.taken if kind != "stepsStarted") == 10
        # Each attempt is observed once: the four before the failure, it, and the rest.
        assert run.observed == [("inc", "done")] * 4 + [("inc", "failed")] + [("inc", "done")] * 6

    async def test_a_chained_async_step_that_fails_is_undone_and_retried(self) -> None:
        """On the loop as in a worker thread: the failing step's changes are undone (not the
        chain's first step's data put back), the steps before it checkpointed first."""
        _FAILED.clear()
        clock = FakeClock()
        run = Chained(AsyncCounter(n=10, fail_at=4), clock, room=31)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.resume, Settings(retry_initial_s=5))
            with anyio.fail_after(10):
                await until(lambda: len(run.retries) >= 1)
                assert run.taken[-1] == ("pool", 4, 4)
                assert isinstance(run.wf, AsyncCounter) and run.wf.i == 4
                clock.advance(5)
        assert [r["attempt"] for r in run.retries] == [1]
        assert isinstance(run.wf, AsyncCounter) and run.wf.i == 10
        assert run.notes.count("step_done") == 10
        assert run.observed == [("inc", "done")] * 4 + [("inc", "failed")] + [("inc", "done")] * 6

    async def test_a_chain_hands_back_a_step_that_runs_elsewhere(self) -> None:
        """A chain of sync steps stops before an async step, a step with a timeout or an
        inline one; each runs where it belongs, once, in order, and is observed done."""
        _WHERE.clear()
        run = Chained(Mixed(), FakeClock(), room=31)
        with anyio.fail_after(10):
            await run.resume(Settings())
        assert isinstance(run.wf, Mixed) and run.wf.ran == list("abcdefgh")
        loop = threading.get_ident()
        assert [_WHERE[name] == loop for name in "abcdefgh"] == [
            False, False, True, False, False, True, True, False
        ]  # fmt: skip
        assert run.notes.count("step_done") == 8
        assert run.observed == [(name, "done") for name in "abcdefgh"]
        assert run.state.status is WorkflowStatus.FINISHED

    @pytest.mark.parametrize("kind", ["sync", "async"])
    async def test_a_runaway_chain_is_raised_by_the_engine(self, kind: str) -> None:
        """Transitions made in a chain count: an endless loop of steps is still caught, on
        the loop as in a worker thread."""
        wf = Counter(n=10**9) if kind == "sync" else AsyncCounter(n=10**9)
        run = Chained(wf, FakeClock(), room=10**9)
        with anyio.fail_after(30), pytest.raises(RunawayWorkflow):
            await run.resume(Settings())

    async def test_show_tells_the_chained_step_running_now(self) -> None:
        """`running` names the step of the chain that runs now, since when it runs."""
        _GATE.__init__()  # type: ignore[misc] # a fresh gate for this test
        _ENTERED.clear()
        run = Chained(Named(), FakeClock(), room=31)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.resume, Settings())
            with anyio.fail_after(10):
                await anyio.to_thread.run_sync(_GATE.entered.wait, 10)
                assert run.pool is not None
                (shown,) = [r.shown() for r in run.pool.running.values()]
                _GATE.open.set()
        assert shown["step"] == "s3"
        assert _ENTERED["s2"] <= shown["running_since"] <= _ENTERED["s3"]
        assert isinstance(run.wf, Named) and run.wf.ran == ["s0", "s1", "s2", "s3", "s4"]
        assert run.notes.count("step_done") == 5
        assert run.observed == [(f"s{i}", "done") for i in range(5)]

    async def test_show_tells_the_chained_async_step_running_now(self) -> None:
        """On the loop too: `running` names the chained async step that waits now, and since
        when (a Unix time between the step before it and its own start)."""
        _ENTERED.clear()
        _ASYNC_GATE[:] = [gate := anyio.Event()]
        run = Chained(AsyncNamed(), FakeClock(), room=31)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.resume, Settings())
            with anyio.fail_after(10):
                await until(lambda: "s3" in _ENTERED)
                assert run.pool is not None
                (shown,) = [r.shown() for r in run.pool.running.values()]
                gate.set()
        assert shown["step"] == "s3"
        assert _ENTERED["s2"] <= shown["running_since"] <= _ENTERED["s3"]
        assert isinstance(run.wf, AsyncNamed) and run.wf.ran == ["s0", "s1", "s2", "s3", "s4"]
        assert run.notes.count("step_done") == 5
        assert run.observed == [(f"s{i}", "done") for i in range(5)]

    async def test_a_stop_ends_the_chain_after_the_running_step(self) -> None:
        """A stop (shutdown) lets the running step finish and starts no next one."""
        _GATE.__init__()  # type: ignore[misc] # a fresh gate for this test
        run = Chained(Counter(n=10, block_at=3), FakeClock(), room=31)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.resume, Settings())
            with anyio.fail_after(10):
                await anyio.to_thread.run_sync(_GATE.entered.wait, 10)
                assert run.pool is not None
                assert [r.step for r in run.pool.running.values()] == ["inc"]
                run.pool.stop()
                _GATE.open.set()
        assert isinstance(run.wf, Counter) and run.wf.i == 4
        thread = run.state.thread("_main_")
        assert thread is not None and (thread.status, thread.cur_step) == ("Executing", "inc")
        assert run.state.status is WorkflowStatus.RESUMING
        assert sum(count for kind, _, count in run.taken if kind != "stepsStarted") == 4

    async def test_a_cancel_abandons_the_chain(self) -> None:
        """Cancelled, the chain's thread is given up on: it finishes its step and moves the
        workflow's state no further."""
        _GATE.__init__()  # type: ignore[misc] # a fresh gate for this test
        run = Chained(Counter(n=10, block_at=3), FakeClock(), room=31)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run.resume, Settings())
                await anyio.to_thread.run_sync(_GATE.entered.wait, 10)
                pc = run.state.pc
                tg.cancel_scope.cancel()
            ended = ABANDONED.total - ABANDONED.running
            _GATE.open.set()
            await until(lambda: ABANDONED.total - ABANDONED.running > ended)
        assert isinstance(run.wf, Counter) and run.wf.i == 4  # the step ran to its end
        assert run.state.pc == pc
        # The chain had moved the state past steps the engine never saw done: the actor
        # reads the workflow back before it goes on (a cancel checks the durable state).
        assert run.pool is not None and run.pool.stale

    async def test_async_steps_chain_on_the_loop(self) -> None:
        """A lone thread's async steps run one after another on the loop, with no checkpoint
        each: one stands for every run of them the pipeline has room for."""
        run = Chained(AsyncCounter(n=20), FakeClock(), room=9)
        with anyio.fail_after(10):
            await run.resume(Settings())
        assert isinstance(run.wf, AsyncCounter) and run.wf.i == 20
        assert run.notes.count("step_done") == 20
        counts = [count for kind, _, count in run.taken if kind == "afterStep"]
        assert counts == [10, 10]


@dataclass
class AsyncCounter(Workflow):
    """Runs `n` async steps; step `fail_at` fails once (its change undone)."""

    n: int = 10
    i: int = 0
    fail_at: int = -1

    async def inc(self) -> None:
        if self.i == self.fail_at and not _FAILED.get(id(self)):
            _FAILED[id(self)] = True
            self.i = -100  # undone with the failed attempt
            raise RuntimeError("once")
        self.i += 1

    def definition(self) -> Section:
        return S(For("loop", self.i < self.n, Step("inc", self.inc)))


_ENTERED: dict[str, float] = {}


@dataclass
class Named(Workflow):
    """Runs sync steps s0 to s4, one after the other; s3 waits for `_GATE`."""

    ran: list[str] = field(default_factory=list)

    def step(self, name: str) -> None:
        _ENTERED[name] = time.time()
        if name == "s3":
            _GATE.entered.set()
            _GATE.open.wait(10)
        self.ran.append(name)

    def definition(self) -> Section:
        return S(*(Step(f"s{i}", partial(self.step, f"s{i}")) for i in range(5)))


@dataclass
class AsyncNamed(Workflow):
    """Runs async steps s0 to s4, one after the other; s3 waits for `_ASYNC_GATE`."""

    ran: list[str] = field(default_factory=list)

    async def step(self, name: str) -> None:
        _ENTERED[name] = time.time()
        if name == "s3":
            await _ASYNC_GATE[0].wait()
        self.ran.append(name)

    def definition(self) -> Section:
        return S(*(Step(f"s{i}", partial(self.step, f"s{i}")) for i in range(5)))


_ASYNC_GATE: list[anyio.Event] = []
_WHERE: dict[str, int] = {}


@dataclass
class Mixed(Workflow):
    """Sync steps a, b, an async c, sync d, e (with a timeout), inline f, async g, sync h."""

    ran: list[str] = field(default_factory=list)

    def sync(self, name: str) -> None:
        _WHERE[name] = threading.get_ident()
        self.ran.append(name)

    async def run_async(self, name: str) -> None:
        self.sync(name)

    def definition(self) -> Section:
        return S(
            Step("a", partial(self.sync, "a")),
            Step("b", partial(self.sync, "b")),
            Step("c", partial(self.run_async, "c")),
            Step("d", partial(self.sync, "d")),
            Step("e", partial(self.sync, "e"), timeout=5),
            Step("f", partial(self.sync, "f"), inline=True),
            Step("g", partial(self.run_async, "g")),
            Step("h", partial(self.sync, "h")),
        )
