"""Running one Step's action: async in the loop, sync in a worker thread, with its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import threading
import time
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from daemon.core.command import Run
from daemon.core.engine import Start
from daemon.core.merge import Fork
from daemon.core.statements import NonRetryableError, Step
from daemon.core.statements import is_async as _is_async
from daemon.runtime.commands import run_command
from daemon.runtime.workers import Workers

log = structlog.get_logger()
_COROUTINE = types.CoroutineType
#: Records a history entry of the workflow the step belongs to.
Note = Callable[[str, dict[str, Any]], None]


@dataclass(slots=True)
class StepRun:
    """One step in flight, as `show` tells it: waiting for a worker slot, or running."""

    step: str
    #: When the step began (time.monotonic()), slot wait included.
    began: float = field(default_factory=time.monotonic)
    #: When (Unix seconds) the step began, slot wait included.
    since: float = field(default_factory=time.time)
    #: Since when (Unix seconds) a sync step waits for one of `max_concurrent_steps` slots.
    queued_since: float | None = None
    #: Since when (Unix seconds) it runs.
    running_since: float | None = None

    def shown(self) -> dict[str, Any]:
        """Return `show`'s `running_step`: the step, `for_s`, and when it queued or began."""
        out: dict[str, Any] = {"step": self.step, "for_s": round(time.monotonic() - self.began, 3)}
        if self.running_since is not None:
            out["running_since"] = self.running_since
        elif self.queued_since is not None:
            out["queued_since"] = self.queued_since
        return out


class Abandoned:
    """Counts the worker threads the daemon gave up on while they still run.

    A thread cannot be stopped; one whose step ran past its timeout (or was cancelled) is
    left to finish on its own, its result dropped. These threads belong to the process, not
    to one workflow or runtime, hence one counter (ABANDONED) for all.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Threads given up on since the start.
        self.total = 0
        #: Of those, the ones still running.
        self.running = 0

    def started(self) -> None:
        """Count a thread given up on."""
        with self._lock:
            self.total += 1
            self.running += 1

    def ended(self) -> None:
        """Count an abandoned thread that has finished."""
        with self._lock:
            self.running -= 1


ABANDONED = Abandoned()
#: The worker threads of sync steps; like ABANDONED, threads belong to the process.
WORKERS = Workers()


def _spent() -> object:
    """Stand in for an action that ran (or never will)."""
    return None


class _Call:
    """A sync action run in a worker thread; tells whether it began, finished or was given up on."""

    def __init__(self, action: Callable[[], object], counter: Abandoned, run: StepRun) -> None:
        self._action, self._counter, self._run = action, counter, run
        self._lock = threading.Lock()
        self._finished = self._abandoned = False
        #: When a worker thread began it (time.monotonic()); its timeout counts from then.
        self.began: float | None = None

    @property
    def abandoned(self) -> bool:
        """Tell whether the daemon gave up on it."""
        return self._abandoned

    def __call__(self) -> object:
        with self._lock:
            if self._abandoned:  # given up on before a thread took it
                self._action = _spent
                return None
            self.began = time.monotonic()
        self._run.queued_since, self._run.running_since = None, time.time()
        try:
            return self._action()
        finally:
            with self._lock:
                self._finished = True
                # A chain's action closes over its call: kept, each chain would be a reference
                # cycle holding its whole resume (actor, pool, definition) for the cyclic GC.
                self._action = _spent
                if self._abandoned:
                    self._counter.ended()

    def abandon(self) -> bool:
        """Give the thread up if it still runs; return whether it did (False if not begun)."""
        with self._lock:
            began = self.began is not None
            if self._finished or self._abandoned:
                return False
            self._abandoned = True
            if began:
                self._counter.started()
            return began


async def run_step(
    step: Step,
    *,
    limiter: anyio.CapacityLimiter,
    note: Note,
    run: StepRun | None = None,
    abandoned: Abandoned = ABANDONED,
    workers: Workers = WORKERS,
    data: object | None = None,
) -> None:
    """Run a step's action to its end; raise what it raises, TimeoutError past its timeout.

    A sync action waits for a slot of `limiter`; its timeout counts from when it has one, and
    past it the slot is freed and the thread abandoned (see _run_sync). `run` is kept up to
    date for `show`. An `inline` sync action runs right here, on the loop, with no slot. A Run
    step's command result goes into `data`'s field `into`, if named.
    """
    run = run or StepRun(step.name)
    started = time.perf_counter()
    if isinstance(step, Run):
        run.running_since = time.time()
        done = await run_command(step, note=note)
        if step.into is not None and data is not None:
            _store_into(data, step.into, done)
    elif _is_async(step.action):
        run.running_since = time.time()
        with _deadline(step.timeout):
            await step.action()
    else:
        if step.inline:
            run.running_since = time.time()
            result = step.action()
        else:
            result = await _run_sync(step, limiter, note, run, abandoned, workers)
        if inspect.isawaitable(result):
            with _deadline(step.timeout):
                await result
    ms = round((time.perf_counter() - started) * 1e6) / 1000  # round(x, 3) costs ~4x as much
    log.info("step_done", step=step.name, duration_ms=ms)
    note("step_done", {"step": step.name, "duration_ms": ms})


#: Where a chain runs: sync steps in a worker thread, async and inline ones on the loop.
THREAD, LOOP = "thread", "loop"
#: How long a chain may run before it hands its steps back to be checkpointed: quick steps
#: share a hand-off and a checkpoint, a slow step's checkpoint is not delayed by the next
#: step (and a chain on the loop holds it no longer than this).
CHAIN_S = 0.001


def chain_kind(step: Step) -> str | None:
    """Return where a step may run in a chain (THREAD or LOOP); None: only on its own.

    Not a command (Run) nor a step with a timeout: these are run by run_step.
    """
    if isinstance(step, Run) or step.timeout:
        return None
    return LOOP if step.inline or _is_async(step.action) else THREAD


@dataclass(slots=True, eq=False)
class Chain:
    """A thread's steps run back to back, with no hand-back to the engine (see Start.follow).

    It begins with one step (`start`, `fork`); after each step that finished, while it has
    `room`, has run for less than `budget_s` and is not `stopped`, the engine is run on to the
    thread's next step, and that one runs too if it chains the same way (chain_kind): sync
    steps in one worker thread, async and inline ones on the loop, on the live data, each
    with the data as it was before it (its undo) and one StepRun for them all. At its end
    `start` and `fork` are the last step's: finished, or failed (the error is raised), or
    the thread `moved` on.
    """

    start: Start
    fork: Fork
    #: How many more steps it may run after the first.
    room: int
    #: It may not go on to a next step (set once the pool stops).
    stopped: bool = False
    #: The steps that finished, in order: each one's name and seconds.
    done: list[tuple[str, float]] = field(default_factory=list)
    #: Steps the engine moved the thread past, in the worker thread (Start.follow).
    stepped: int = 0
    #: The engine moved the thread on past the last step (see Done.moved).
    moved: bool = False
    #: Given up on (a cancel) after it moved the thread on: the engine never saw that.
    stale: bool = False
    #: What the last step's sync action returned to be awaited on the loop, if anything.
    pending: Awaitable[Any] | None = None
    #: How long it may go on to next steps after its first began (CHAIN_S by default).
    budget_s: float = CHAIN_S
    #: When (time.monotonic()) it stops going on to next steps.
    until: float = 0.0
    #: The running step's undo (from Start.follow) while it is not yet `fork`'s.
    undo: bytes | None = None

    def settle(self) -> None:
        """Make `fork` the last step's (its Fork is made once, not per step)."""
        if self.undo is not None:
            self.fork, self.undo = self.start.forked(self.undo), None


async def run_chain(
    chain: Chain,
    *,
    limiter: anyio.CapacityLimiter,
    note: Note,
    running: dict[str, StepRun],
    thread_id: str,
    observe: Callable[[str, str, float], None] | None = None,
    abandoned: Abandoned = ABANDONED,
    workers: Workers = WORKERS,
    noted: Note | None = None,
) -> None:
    """Run a chain of steps; raise what its last step raised.

    Sync steps run in one worker thread and slot: one thread hand-off for the whole chain
    instead of one per step. `running[thread_id]` is the StepRun of the step running now
    (for `show`). Each step that finished is logged as `step_done` and noted, as run_step
    does (a thread's chain once it is back); `observe` is told of each but the last as
    "done" (its caller reports that one). `noted`, if given, is the workflow's own note,
    told the thread in the detail (`note` is then only for what a cancel reports). A cancel
    abandons the thread, as for one step, and the chain stops before its next step.
    """
    if chain_kind(chain.fork.step) == LOOP:
        try:
            await _chain_here(chain, running[thread_id])
        except Exception:
            chain.settle()
            _chain_done(chain, note, noted, thread_id, observe, last=False)
            raise
        finally:
            chain.settle()
        _chain_done(chain, note, noted, thread_id, observe)
        return
    run = running[thread_id]
    run.queued_since = time.time()
    call: _Call

    def body() -> object:
        _chain(chain, call, run)
        return None

    call = _Call(body, abandoned, run)
    job = workers.submit(call, limiter.total_tokens)
    try:
        await job.future
    except Exception:
        chain.settle()
        _chain_done(chain, note, noted, thread_id, observe, last=False)
        raise
    except BaseException:
        began = call.abandon()
        # From here on the thread moves the state no more (see _chain).
        chain.settle()
        if began:
            _report(chain.fork.step, note, "cancelled", abandoned)
        chain.stale = chain.stepped > 0
        workers.forget(job)
        raise
    workers.forget(job)
    chain.settle()
    if chain.pending is not None:
        _chain_done(chain, note, noted, thread_id, observe, last=False)
        chain.done = []
        await chain.pending
        chain.done.append((run.step, time.monotonic() - run.began))
    _chain_done(chain, note, noted, thread_id, observe)


def _chain(chain: Chain, call: _Call, run: StepRun) -> None:
    """Run the chain's steps, in the worker thread; a step's exception ends it (and is raised)."""
    start, done = chain.start, chain.done
    action = chain.fork.step.action
    # One clock for the durations, the budget and `show`'s `for_s`: three clock reads per
    # step, not four (`show`'s Unix times are read as they are, not derived from it).
    mono = time.monotonic
    began = mono()
    chain.until = began + chain.budget_s
    while True:
        result = action()
        if result is not None and inspect.isawaitable(result):
            chain.pending = result
            return
        ended = mono()
        done.append((run.step, ended - began))
        if chain.room <= 0 or ended >= chain.until or chain.stopped:
            return
        # Under the call's lock: once the loop has given the chain up (and reads the state
        # again), it moves the workflow's state no more.
        with call._lock:
            if call._abandoned:
                return
            undo = start.follow(False)
            chain.stepped += 1
            if undo is None:
                chain.moved = True  # follow() moved the thread past the step that finished
                return
            chain.undo = undo
        chain.room -= 1
        step = start.step
        action = step.action
        # The chain's one StepRun tells `show` of each step in turn.
        began = mono()
        run.step, run.began = step.name, began
        run.since = run.running_since = time.time()


async def _chain_here(chain: Chain, run: StepRun) -> None:
    """Run the chain's async and inline steps on the loop, as run_step runs one."""
    start, done = chain.start, chain.done
    action: Callable[[], Any] = chain.fork.step.action
    mono = time.monotonic  # one clock for all but `show`'s Unix times, as in _chain
    began = mono()
    chain.until = began + chain.budget_s
    run.running_since = time.time()
    while True:
        result = action()
        # A coroutine told by its type first: inspect.isawaitable is a Python call.
        if result is not None and (type(result) is _COROUTINE or inspect.isawaitable(result)):
            await result
        ended = mono()
        done.append((run.step, ended - began))
        if chain.room <= 0 or ended >= chain.until or chain.stopped:
            return
        undo = start.follow(True)
        chain.stepped += 1
        if undo is None:
            chain.moved = True
            return
        chain.undo = undo
        chain.room -= 1
        step = start.step
        action = step.action
        began = mono()
        run.step, run.began = step.name, began
        run.since = run.running_since = time.time()


def _chain_done(
    chain: Chain,
    note: Note,
    noted: Note | None,
    thread_id: str,
    observe: Callable[[str, str, float], None] | None,
    *,
    last: bool = True,
) -> None:
    """Log and note each finished step of the chain; observe each but the last (see run_chain)."""
    info = log.info  # looked up once (through structlog's lazy proxy) for the whole chain
    done = chain.done
    final = len(done) - 1 if last else len(done)
    for i, (name, seconds) in enumerate(done):
        ms = round(seconds * 1e6) / 1000  # what round(x * 1000, 3) gives, at a quarter of its cost
        info("step_done", step=name, duration_ms=ms)
        if noted is not None:
            noted("step_done", {"step": name, "duration_ms": ms, "thread": thread_id})
        else:
            note("step_done", {"step": name, "duration_ms": ms})
        if observe is not None and i != final:
            observe(name, "done", seconds)


def _store_into(data: object, field: str, value: dict[str, Any]) -> None:
    """Set a Run step's result on the data field `field`; a field that is not there fails it."""
    names = {f.name for f in dataclasses.fields(data)} if dataclasses.is_dataclass(data) else ()
    if field not in names:
        raise NonRetryableError(f"Run(into={field!r}): {type(data).__name__} has no such field")
    setattr(data, field, value)


def _deadline(timeout: float | None) -> contextlib.AbstractContextManager[Any]:
    return anyio.fail_after(timeout) if timeout else contextlib.nullcontext()


async def _run_sync(
    step: Step,
    limiter: anyio.CapacityLimiter,
    note: Note,
    run: StepRun,
    abandoned: Abandoned,
    workers: Workers,
) -> object:
    """Run a sync action in a worker thread, in one of `limiter.total_tokens` slots.

    The workers hold the slots (see Workers): a step waits in their queue until a thread with
    a free slot takes it, and its timeout counts from then. A thread cannot be cancelled. So
    past the step's timeout, or on a cancel (shutdown, `cancel`), the thread is abandoned
    instead of waited for: its slot goes to the next step at once (a hung step must not
    starve every other workflow), its result is dropped, and the step fails with TimeoutError
    (and is retried) or stops. It is counted (ABANDONED) and logged as `step_abandoned`.
    """
    run.queued_since = time.time()
    call = _Call(step.action, abandoned, run)
    job = workers.submit(call, limiter.total_tokens)
    future, timeout = job.future, step.timeout
    try:
        if not timeout:
            return await future
        while not future.done():
            began = call.began
            left = timeout if began is None else began + timeout - time.monotonic()
            if left <= 0:
                break
            # asyncio.wait, not a cancel scope: a step still queued keeps its place.
            await asyncio.wait([future], timeout=left)
        if future.done() or not call.abandon():
            return await future
    except BaseException:
        if call.abandon():
            _report(step, note, "cancelled", abandoned)
        workers.forget(job)
        raise
    workers.forget(job)
    _report(step, note, "timeout", abandoned)
    raise TimeoutError(f"ran over its timeout of {timeout:g} s; its thread was abandoned")


def _report(step: Step, note: Note, reason: str, abandoned: Abandoned) -> None:
    detail = {"step": step.name, "reason": reason, "timeout_s": step.timeout}
    log.warning(
        "step_abandoned",
        **detail,
        abandoned_running=abandoned.running,
        abandoned_total=abandoned.total,
    )
    note("step_abandoned", detail)
