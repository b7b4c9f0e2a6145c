"""The workflow engine: state, `resume` and `handle_callback`; pure, no I/O of its own."""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from daemon.core.command import Run

# Explicit re-exports (mypy's idiom): daemon.core.engine.Definition and .validate stay importable.
from daemon.core.definition import (
    BRANCHING,
    BREAK,
    CONTINUE,
    FOR,
    GO,
    KIND_CODE,
    LEAF,
    RETURN,
    SECTION,
    WAIT,
    Definable,
    dispatch_entry,
)
from daemon.core.definition import Definition as Definition  # noqa: PLC0414
from daemon.core.definition import validate as validate  # noqa: PLC0414
from daemon.core.handler import CallbackRequest, Handler
from daemon.core.merge import Fork, apply, fork
from daemon.core.state import (
    ARMED,
    FINAL_STATUSES,
    MAIN_THREAD,
    RUNNABLE,
    SETUP_DUE,
    TEARDOWN_DUE,
    CheckpointType,
    EventStatus,
    State,
    Thread,
    ThreadStatus,
    WaitEvent,
    WorkflowStatus,
)
from daemon.core.statements import (
    For,
    Go,
    On,
    Section,
    Step,
    Stmt,
    Wait,
    WaitFor,
    _Branching,
    is_async,
    truth,
)
from daemon.core.waits import (
    describe,
    drop_ended_threads,
    release_thread,
    teardown_waits,
)
from daemon.core.waits import release_waits as release_waits  # noqa: PLC0414
from daemon.errors import (
    CallbackNotFound,
    HandlerRejected,
    RunawayWorkflow,
    StaleCallback,
    StepFailed,
    StepNotFound,
    ValidationError,
    WorkflowdError,
)

_encoder = msgspec.json.Encoder()
# Enum members read on every transition (an Enum class attribute costs ~0.1 µs in 3.11).
_EXECUTING, _RESUMING = ThreadStatus.EXECUTING, ThreadStatus.RESUMING
_WAITING_EVENT, _WAITING_CONDITION = ThreadStatus.WAITING_EVENT, ThreadStatus.WAITING_CONDITION
_PENDING_SETUP, _SETUP = EventStatus.PENDING_SETUP, EventStatus.SETUP
_AFTER_STEP, _AFTER_RESUME = CheckpointType.AFTER_STEP, CheckpointType.AFTER_RESUME
_STEPS_STARTED = CheckpointType.STEPS_STARTED

#: A handler class attribute: True tells that its `setup` shows nothing outside the workflow
#: (it starts, binds and arms nothing; a timer is armed by the runtime once it is saved), so
#: the steps before such a wait need not be durable before its setup runs.
QUIET_SETUP = "quiet_setup"

#: Transitions one `resume` may make before the workflow is declared a runaway.
MAX_TRANSITIONS = 10_000


Checkpoint = Callable[[CheckpointType], Awaitable[None]]
StepRunner = Callable[[Step], Awaitable[None]]
#: Told of each field (its path, the step, the thread) that a step's merge found changed
#: differently by an overlapping step.
OnConflict = Callable[[str, str, str], None]


@dataclass(slots=True)
class Done:
    """A step that ended: its fork to merge, its failure, or neither (it was never run)."""

    thread_id: str
    fork: Fork | None = None
    failure: StepFailed | None = None
    #: The runner ran the engine on past the step, through `Start.then`: its thread is
    #: stepped and stopped somewhere new (and `fork` is None).
    moved: bool = False


class Steps(Protocol):
    """Runs the engine's steps, each against its own fork; several may be in flight."""

    def start(self, thread_id: str, make_fork: Callable[..., Fork]) -> None:
        """Begin running a thread's step; `make_fork()` copies the data as it is then.

        `make_fork(alone=True)` (see daemon.core.merge.fork) may be used for a step that no
        other can overlap: one alone in flight while the engine waits in `next`. The engine
        passes a `Start`, whose `then` lets a runner go on to the thread's next step itself.
        """

    async def next(self) -> list[Done]:
        """Wait for at least one started step to end; return those that have, in order."""


class _Inline:
    """Runs one step at a time, in the order they were started (for the engine's own tests)."""

    def __init__(self, run_step: StepRunner) -> None:
        self.run_step = run_step
        self.queue: deque[tuple[str, Callable[..., Fork]]] = deque()

    def start(self, thread_id: str, make_fork: Callable[..., Fork]) -> None:
        self.queue.append((thread_id, make_fork))

    async def next(self) -> list[Done]:
        thread_id, make_fork = self.queue.popleft()
        f = make_fork(alone=True)  # forked when it runs, so it overlaps no other step
        failure = await _run_forked(f, self.run_step)
        if failure is not None:
            return [Done(thread_id, failure=failure)]
        return [Done(thread_id, f)]


async def _run_forked(f: Fork, run_step: StepRunner) -> StepFailed | None:
    """Run a forked step to its end; return its failure (its changes undone), or None."""
    try:
        if run_step is _run_step:  # the default: the action is called here, one frame less
            result = f.step.action()
            if result is not None and inspect.isawaitable(result):
                await result
        else:
            await run_step(f.step)
        f.finish()
    except Exception as e:  # noqa: BLE001 - the engine raises it as StepFailed
        f.discard()
        return StepFailed(f.step.name, e)
    return None


class Start:
    """A thread's step the engine hands its runner: called, it makes the step's fork.

    `then` runs the engine on from the finished step to the thread's next Step, so that a
    runner may run a chain of a thread's steps without handing each back (a worker thread
    runs sync steps back to back). It is called on the runner's own thread while the engine
    waits in `Steps.next`, for a step that ran alone on the live data.
    """

    __slots__ = ("_async", "_func", "_type", "resumer", "step", "thread")

    def __init__(self, resumer: _Resumer, thread: Thread, step: Step) -> None:
        self.resumer, self.thread, self.step = resumer, thread, step
        #: The last action `follow` looked at: its function, its type, and whether async.
        self._func: object = None
        self._type: type | None = None
        self._async = False

    def __call__(self, *, alone: bool = False) -> Fork:
        return fork(self.resumer.wf, self.step, alone=alone)

    def then(self, done: Fork) -> Start | None:
        """Move the thread past `done` (finished in place); return its next Step, or None.

        None: the thread stopped at something else (a wait, its end, a Step while another
        thread needs the engine), and the runner reports `Done(thread_id, moved=True)`. A
        Start returned is not begun: run it after `begin()`, or report `moved` and the
        engine starts it as usual. An error here is raised by the engine, not the runner.
        """
        r, t = self.resumer, self.thread
        if done.undo is None or done.step is not self.step or r.error is not None:
            raise WorkflowdError("Start.then: only for the lone step this Start made, once")
        try:
            # What the engine's loop does for a finished step and the thread it resumes.
            r.stepped(t)
            r.budget -= 1
            if r.budget < 0:
                raise r.runaway(t)
            r.advance(t)
            step = r.ready.get(t.id)
            if step is None or not r.alone(t):
                return None
            return Start(r, t, step)
        except Exception as e:  # noqa: BLE001 - raised by the engine once it has the thread back
            r.error = e
            return None

    def begin(self) -> bool:
        """Take the step as started (a transition) before running it; False: do not run it.

        False when the workflow ran out of transitions: the engine raises that error.
        """
        r = self.resumer
        try:
            r.tick(self.thread)
        except Exception as e:  # noqa: BLE001 - raised by the engine once it has the thread back
            r.error = e
            return False
        r.ready.pop(self.thread.id, None)
        return True

    def follow(self, on_loop: bool) -> bytes | None:
        """Move the thread past this Start's step (finished in place) and begin the next one.

        What `then`, `begin` and `fork(alone=True)` do for a runner's chain, with no Start
        made per step: the thread's next Step becomes this Start's `step` and the data as it
        is now is returned, to be put back (`wf.restore`) if that step fails. Only a Step
        that runs where the chain does: on the loop (`on_loop`: an async or inline action)
        or in a worker thread (a sync one), not a Run nor one with a timeout. None: the
        thread stopped elsewhere, or at a step that does not chain (the engine starts it),
        or an error is due (the engine raises it); the runner reports `moved` either way.
        """
        r, t = self.resumer, self.thread
        if r.error is not None:
            raise WorkflowdError("Start.follow: the engine has an error to raise first")
        r.stepped(t)
        try:
            r.budget -= 1
            if r.budget < 0:
                raise r.runaway(t)
            r.advance(t)
        except Exception as e:  # noqa: BLE001 - raised by the engine once it has the thread back
            r.error = e
            return None
        step = r.ready.get(t.id)
        if step is None or step.timeout or isinstance(step, Run):
            return None
        if len(r.state.threads) > 1 and not r.alone(t):
            return None
        action = step.action
        func = getattr(action, "__func__", action)
        if func is not self._func or type(action) is not self._type:
            # Asked once per function: a chain's steps are mostly one method, bound anew.
            self._func, self._type, self._async = func, type(action), is_async(action)
        if (step.inline or self._async) is not on_loop:
            return None
        if r.budget <= 0:  # the engine's own start of it raises the runaway
            return None
        r.budget -= 1  # begin's transition
        del r.ready[t.id]
        self.step = step
        return _encoder.encode(r.wf)

    def forked(self, undo: bytes) -> Fork:
        """Return the Fork of this Start's step run in place from `undo` (see `follow`)."""
        return Fork(self.resumer.wf, self.step, {}, undo=undo)


def _ignore_conflict(path: str, step: str, thread_id: str) -> None:
    return None


async def call_action(fn: Callable[[], object]) -> object:
    """Call a sync or async zero-argument callable."""
    result = fn()
    if result is not None and inspect.isawaitable(result):
        return await result
    return result


async def _run_step(step: Step) -> None:
    await call_action(step.action)


_BREAK, _CONTINUE, _RETURN = object(), object(), object()
_new = object.__new__
#: What running a statement may stop at: a Step to run, a Wait or WaitFor to block on,
#: one of the sentinels above, or None (go on).
_Stop = Step | Wait | WaitFor | object | None


class _Cursor:
    """Walks one thread through the definition: searching for `cur_step`, then running."""

    __slots__ = ("resumer", "running", "thread")

    def __init__(self, resumer: _Resumer, thread: Thread) -> None:
        self.resumer, self.thread = resumer, thread
        self.running = thread.cur_step == ""

    def run(self, stmt: Stmt) -> _Stop:
        return self.block(stmt.stmts if isinstance(stmt, Section) else (stmt,))

    def block(self, stmts: tuple[Any, ...]) -> _Stop:
        # The statements of a block in one frame: leaves and jumps are handled inline, and
        # only compound statements cost a call (this runs for every transition).
        for s in stmts:
            kind = KIND_CODE.get(type(s)) or dispatch_entry(KIND_CODE, s)
            if kind is LEAF:
                if self.running:
                    return s  # type: ignore[no-any-return]
                if self.thread.cur_step == s.name:
                    self.running = True
                continue
            if kind is WAIT:
                if self.running:
                    return s  # type: ignore[no-any-return]
                stop = self._wait(s)
            elif kind is FOR:
                stop = self._loop(s)
            elif kind is BRANCHING:
                stop = self._branch(s)
            elif kind is SECTION:
                stop = self.block(s.stmts)
            elif kind is GO:
                if self.running:
                    self._go(s)
                continue
            else:  # Break, Continue, Return
                if self.running:
                    return _JUMPS[kind]
                continue
            if stop is not None:
                return stop
        return None

    def _branch(self, stmt: _Branching) -> _Stop:
        if self.running:
            for b in stmt.branches:
                cond = b.cond
                if b.default or cond is True or (cond is not False and truth(cond)):
                    return self.block(b.body.stmts)
            return None
        for b in stmt.branches:
            if self.thread.cur_step == b.name:
                self.running = True
                return self.block(b.body.stmts)
            stop = self.block(b.body.stmts)
            if stop is not None or self.running:
                return stop
        return None

    def _loop(self, stmt: For) -> _Stop:
        body = stmt.body.stmts
        # A body that starts with a Step, WaitFor or Wait (most loops) stops there at once,
        # as block(body) would: one call less for each step run in a loop.
        first = KIND_CODE.get(type(body[0])) if body else None
        if not self.running:
            cur = self.thread.cur_step
            if cur == stmt.name:
                self.running = True
            elif first is LEAF and body[0].name == cur and len(body) == 1:  # type: ignore[attr-defined]
                # The search ends at the body's only statement, as block(body) would find it
                # (a loop of one step: one call less for each of its steps).
                self.running = True
            else:
                stop = self.block(body)
                if not self.running:
                    return None
                if stop is _BREAK:
                    return None
                if stop is not None and stop is not _CONTINUE:
                    return stop
        r, cond = self.resumer, stmt.cond
        at_once = first is LEAF or first is WAIT
        while cond is True or (cond is not False and truth(cond)):
            r.budget -= 1
            if r.budget < 0:
                raise r.runaway(self.thread)
            if at_once:
                return body[0]
            stop = self.block(body)
            if stop is _BREAK:
                return None
            if stop is not None and stop is not _CONTINUE:
                return stop
        return None

    def _wait(self, stmt: Wait) -> _Stop:
        t = self.thread
        if t.cur_step == stmt.name:
            self.running = True
            if not t.cur_callback:
                return stmt
            for case in stmt.cases:
                if case.event == t.cur_callback:
                    t.cur_callback = ""
                    return self.block(case.body.stmts)
            raise StepNotFound(
                f"thread {t.id}: wait {stmt.name!r} has no case {t.cur_callback!r} any more"
            )
        for c in stmt.cases:
            stop = self.block(c.body.stmts)
            if stop is not None or self.running:
                return stop
        return None

    def _go(self, stmt: Go) -> None:
        tid, state = stmt.thread_id, self.resumer.state
        if state.thread(tid) is not None:
            raise WorkflowdError(f"thread {tid!r} is already running (give Go an id= per loop)")
        state.threads.append(Thread(tid, stmt.name))


_JUMPS: dict[str, object] = {BREAK: _BREAK, CONTINUE: _CONTINUE, RETURN: _RETURN}


class _Resumer:
    """One `resume` call: the definition is rebuilt only after the data may have changed."""

    def __init__(
        self, wf: Definable, state: State, checkpoint: Checkpoint, defn: Definition | None = None
    ):
        self.wf, self.state, self.checkpoint = wf, state, checkpoint
        # Validated once per call, as the seed does (or by whoever built `defn` from the data
        # as it is now); rebuilds are indexed only when needed.
        if defn is None:
            defn = Definition(wf.definition())
        self._root: Section | None = defn.root
        self._defn: Definition | None = defn
        # What cursors stopped at in the current tree, so most lookups need no index:
        # the Step each thread runs next (by thread id) and the cases of Waits (by event).
        self.ready: dict[str, Step] = {}
        self.cases: dict[str, On] = {}
        self.budget = MAX_TRANSITIONS
        #: What went wrong in `Start.then`, on the runner's thread: raised on the engine's.
        self.error: Exception | None = None

    @property
    def defn(self) -> Definition:
        """Return the current tree, indexed (and validated) on first use."""
        if self._defn is None:
            self._defn = Definition(self.root)
        return self._defn

    @property
    def root(self) -> Section:
        """Return the current tree, built from the data on first use after a change."""
        if self._root is None:
            self._root = self.wf.definition()
        return self._root

    def tick(self, t: Thread) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise self.runaway(t)

    def runaway(self, t: Thread) -> RunawayWorkflow:
        return RunawayWorkflow(
            f"workflow {self.state.id} made {MAX_TRANSITIONS} transitions without "
            f"blocking (thread {t.id} near {t.cur_step!r}); endless loop?"
        )

    def alone(self, t: Thread) -> bool:
        """Tell whether every thread but `t` waits for an event (nothing else for the engine)."""
        # A loop, not all() over a generator: this runs after every step of a chain.
        for o in self.state.threads:  # noqa: SIM110
            if o is not t and o.status is not _WAITING_EVENT:
                return False
        return True

    def step_of(self, t: Thread) -> Step:
        step = self.ready.pop(t.id, None) or self.defn.get(t.cur_step, Step)
        if step is None:
            raise StepNotFound(f"thread {t.id}: step {t.cur_step!r} is not in the definition")
        return step

    def stepped(self, t: Thread) -> None:
        """Move `t` past the Step it ran or the WaitFor it waited on; the caller checkpoints."""
        t.status = _RESUMING
        t.pc += 1
        self.state.pc += 1
        # Built when next needed: several steps may complete (and merge) before that. Most
        # rebuilds are only walked by a cursor, so indexing waits until a lookup needs it.
        self._root = self._defn = None
        if self.ready:
            self.ready.clear()
        if self.cases:
            self.cases.clear()

    def advance(self, t: Thread) -> None:
        """Move `t` on to where it must stop; the caller checkpoints (AFTER_RESUME)."""
        s = self.state
        if t.name == MAIN_THREAD:
            body = self._root
            if body is None:
                body = self._root = self.wf.definition()
        elif (go := self.defn.get(t.name, Go)) is not None:
            body = go.body
        else:
            raise StepNotFound(f"thread {t.id}: Go {t.name!r} is not in the definition")
        # A cursor per transition: one kept on the resumer would be a reference cycle
        # (resumer <-> cursor) holding the whole resume for the cyclic GC. Made without a
        # call to __init__ (this runs for every transition).
        cursor = _new(_Cursor)
        cursor.resumer, cursor.thread, cursor.running = self, t, t.cur_step == ""
        t.pc += 1
        s.pc += 1
        stop = cursor.block(body.stmts) if type(body) is Section else cursor.run(body)
        if stop is None and not cursor.running:
            raise StepNotFound(f"thread {t.id}: statement {t.cur_step!r} is not in the definition")
        if stop is None or stop is _RETURN:
            self.end_thread(t)
        elif isinstance(stop, Step):
            t.cur_step, t.status = stop.name, _EXECUTING
            self.ready[t.id] = stop
        elif isinstance(stop, WaitFor):
            t.cur_step, t.status = stop.name, _WAITING_CONDITION
        elif isinstance(stop, Wait):
            t.cur_step, t.status = stop.name, _WAITING_EVENT
            for c in stop.cases:
                req = CallbackRequest(s.id, t.id, c.event, t.pc)
                t.wait_events.append(WaitEvent(c.handler.type, req))
                self.cases[c.event] = c
        else:  # Break/Continue escaped every For: validate() rules this out
            raise ValidationError(f"thread {t.id}: Break/Continue outside a For")

    def end_thread(self, t: Thread) -> None:
        s = self.state
        if t.id != MAIN_THREAD:
            s.threads.remove(t)
            return
        s.status = WorkflowStatus.FINISHED
        t.status, t.cur_step = ThreadStatus.RESUMING, ""
        release_waits(s)

    async def check_conditions(self) -> bool:
        # One condition at a time: a WaitFor handler may change data another condition reads,
        # so the caller rebuilds the definition and checks again.
        for t in self.state.threads:
            if t.status is not _WAITING_CONDITION:
                continue
            wf = self.defn.get(t.cur_step, WaitFor)
            if wf is None:
                raise StepNotFound(
                    f"thread {t.id}: wait_for {t.cur_step!r} is not in the definition"
                )
            if not truth(wf.cond):
                continue
            if wf.handler is not None:
                await call_action(wf.handler)
            self.stepped(t)
            await self.checkpoint(CheckpointType.AFTER_CONDITION)
            return True
        return False

    async def teardown(self) -> None:
        await teardown_waits(self.state, self.handler, self.checkpoint)

    async def setup(self) -> None:
        for t in self.state.threads:
            for ev in t.wait_events:
                if ev.status not in SETUP_DUE:
                    continue
                try:
                    data = await self.handler(ev).setup(ev.req)
                except Exception as e:  # noqa: BLE001 - any handler failure is recorded
                    # Recorded on the wait so `show` explains it; the runtime retries with backoff.
                    ev.status, ev.error = EventStatus.SETUP_ERROR, describe(e)
                    continue
                ev.status, ev.error, ev.req.setup_data = _SETUP, "", data
                await self.checkpoint(CheckpointType.AFTER_SETUP)

    def quiet_setups(self) -> bool:
        """Tell whether every wait due for setup has a quiet handler (see QUIET_SETUP)."""
        for t in self.state.threads:
            for ev in t.wait_events:
                if ev.status not in SETUP_DUE:
                    continue
                try:
                    handler = self.handler(ev)
                except Exception:  # noqa: BLE001 - setup records it; until then, not quiet
                    return False
                if getattr(handler, QUIET_SETUP, False) is not True:
                    return False
        return True

    def handler(self, ev: WaitEvent) -> Handler:
        on = self.cases.get(ev.req.name) or self.defn.get(ev.req.name, On)
        if on is None:
            raise StepNotFound(f"event {ev.req.name!r} is not in the definition")
        return on.handler


async def resume(
    wf: Definable,
    state: State,
    checkpoint: Checkpoint,
    *,
    run_step: StepRunner = _run_step,
    steps: Steps | None = None,
    on_conflict: OnConflict = _ignore_conflict,
    definition: Definition | None = None,
) -> Definition | None:
    """Run the workflow until every thread is blocked or it has finished.

    Each thread's step runs against its own fork of the data, through `steps` (by default
    one at a time with `run_step`); steps of different threads may overlap, and each one's
    changes are merged into `wf` when it ends (see daemon.core.merge). A checkpoint is taken
    before waiting for steps, so it holds the completed ones and those in flight, never a
    half-done step.

    Checkpoints of kind AFTER_RESUME (and AFTER_SETUP, AFTER_TEARDOWN) need not be durable:
    the caller saves the workflow once resume returns, and that save holds them.

    `definition`, if given, is the Definition built from the data as it is now (it saves a
    build). Returns the Definition of the data as the resume leaves it, if it has one built
    (None when the data changed since the last build), for the caller to pass on.
    """
    if state.status in FINAL_STATUSES:
        raise WorkflowdError(f"workflow {state.id} is already {state.status}")
    r = _Resumer(wf, state, checkpoint, definition)
    state.pc += 1
    if _due(state, TEARDOWN_DUE):
        await r.teardown()
    stepped = started = False
    if steps is None and len(state.threads) == 1:
        stepped = await _lone_thread(r, state.threads[0], run_step, on_conflict)
    runner = steps  # the engine's own made when a step first needs it
    #: Threads whose step is in flight, and those whose step was not run (stopping).
    flight: set[str] = set()
    held: set[str] = set()
    # The loop's common work is inline (no call per pass): finding a runnable thread,
    # counting the transition, and seeing that no thread waits on a condition.
    while state.status not in FINAL_STATUSES:
        conditions = False
        for t in state.threads:
            status = t.status
            if status in RUNNABLE and t.id not in flight and t.id not in held:
                break
            if status is _WAITING_CONDITION:
                conditions = True
        else:
            t = None
        if t is not None:
            r.budget -= 1
            if r.budget < 0:
                raise r.runaway(t)
            if t.status is _EXECUTING:
                step = r.ready.pop(t.id, None) or r.step_of(t)
                if runner is None:
                    runner = _Inline(run_step)
                runner.start(t.id, Start(r, t, step))
                flight.add(t.id)
                started = True
            else:
                r.advance(t)
                await checkpoint(_AFTER_RESUME)
            continue
        if conditions and await r.check_conditions():
            continue
        if not flight:
            break
        if stepped or started:
            await checkpoint(_AFTER_STEP if stepped else _STEPS_STARTED)
            stepped = started = False
        assert runner is not None  # a step is in flight, so it was started
        for done in await runner.next():
            flight.discard(done.thread_id)
            if done.failure is not None:
                raise done.failure
            if r.error is not None:
                raise r.error
            if done.moved:  # stepped (and advanced) by the runner: see Start.then
                stepped = True
                continue
            t = state.thread(done.thread_id)
            if done.fork is None or t is None:
                held.add(done.thread_id)
                continue
            for path in apply(wf, done.fork):
                on_conflict(path, done.fork.step.name, t.id)
            r.stepped(t)
            stepped = True
    if stepped:
        # Waits set up next may tell the outside (a listener, a child's start): what led to
        # them is made durable first. Only quiet ones due (a signal's, a timer's): the steps
        # are saved with them, in the caller's save once resume returns (one write, not two).
        quiet = state.status not in FINAL_STATUSES and r.quiet_setups()
        await checkpoint(_AFTER_RESUME if quiet else _AFTER_STEP)
    if state.status in FINAL_STATUSES:
        if _due(state, TEARDOWN_DUE):
            await r.teardown()
        drop_ended_threads(state)
    if _due(state, SETUP_DUE):
        await r.setup()
    state.update_status()
    return r._defn


async def _lone_thread(
    r: _Resumer, t: Thread, run_step: StepRunner, on_conflict: OnConflict
) -> bool:
    """Run a workflow's only thread with the engine's own runner; return whether it stepped.

    The general loop's passes for this case, flat: the same transitions and checkpoints in
    the same order, without the bookkeeping of steps in flight. It returns as soon as the
    thread blocks or another thread appears (a Go), and the general loop takes over from
    there as from the top of one of its passes.
    """
    state, checkpoint, threads = r.state, r.checkpoint, r.state.threads
    stepped = False
    while state.status not in FINAL_STATUSES and len(threads) == 1:
        status = t.status
        if status is _RESUMING:
            r.budget -= 1
            if r.budget < 0:
                raise r.runaway(t)
            r.advance(t)
            await checkpoint(_AFTER_RESUME)
        elif status is _EXECUTING:
            r.budget -= 1
            if r.budget < 0:
                raise r.runaway(t)
            step = r.ready.pop(t.id, None) or r.step_of(t)
            await checkpoint(_AFTER_STEP if stepped else _STEPS_STARTED)
            if step.timeout:  # run on a copy of the data, then merged (see fork)
                f = fork(r.wf, step, alone=True)
                failure = await _run_forked(f, run_step)
                if failure is not None:
                    raise failure
                for path in apply(r.wf, f):
                    on_conflict(path, f.step.name, t.id)
            else:
                # What fork(alone=True) and `_run_forked` do, without their frames and
                # objects (this runs for every step): on the live data, undone if it fails.
                undo, failure = _encoder.encode(r.wf), None
                try:
                    if run_step is _run_step:
                        result = step.action()
                        if result is not None and inspect.isawaitable(result):
                            await result
                    else:
                        await run_step(step)
                except Exception as e:  # noqa: BLE001 - raised as StepFailed, as from `_Inline`
                    r.wf.restore(undo)
                    failure = StepFailed(step.name, e)
                if failure is not None:
                    raise failure
            r.stepped(t)
            stepped = True
        else:
            break
    return stepped


async def handle_callback(
    req: CallbackRequest,
    wf: Definable,
    state: State,
    input: Any,
    *,
    definition: Definition | None = None,
) -> Any:
    """Apply an event to the thread waiting for it and return the handler's output.

    `definition`, if given, is the Definition built from the data as it is now (it saves a
    build); once the handler has run, it may no longer be.
    """
    defn = definition if definition is not None else Definition(wf.definition())
    if state.status in FINAL_STATUSES:
        raise CallbackNotFound(f"workflow {state.id} is {state.status}; it waits for nothing")
    thread, event = _find_waiting(state, req)
    if req.pc and req.pc != event.req.pc:
        raise StaleCallback(
            f"callback {req.name!r} carries pc {req.pc}, the wait expects {event.req.pc}"
        )
    on = defn.get(req.name, On)
    if on is None:
        raise CallbackNotFound(f"event {req.name!r} is not in the definition")
    snap = wf.snapshot()
    try:
        out = await on.handler.handle(event.req, input)
    except Exception as e:
        # The caller may retry, so the handler must leave no trace.
        wf.restore(snap)
        if isinstance(e, WorkflowdError):
            raise
        raise HandlerRejected(f"event {req.name!r}: {describe(e)}") from e
    state.pc += 1
    event.handled = True
    thread.cur_callback = req.name
    release_thread(thread)
    thread.status = _RESUMING
    thread.pc += 1
    state.update_status()
    return out


def _due(state: State, statuses: tuple[EventStatus, ...]) -> bool:
    """Tell whether any wait of any thread has one of `statuses` (most resumes have none)."""
    for t in state.threads:
        for ev in t.wait_events:
            if ev.status in statuses:
                return True
    return False


def _find_waiting(state: State, req: CallbackRequest) -> tuple[Thread, WaitEvent]:
    for t in state.threads:
        if (req.thread_id and t.id != req.thread_id) or t.status is not _WAITING_EVENT:
            continue
        for ev in t.wait_events:
            if ev.req.name == req.name and ev.status in ARMED:
                return t, ev
    if req.thread_id and all(t.id != req.thread_id for t in state.threads):
        threads = ", ".join(t.id for t in state.threads) or "none"
        raise CallbackNotFound(
            f"workflow {state.id} has no thread {req.thread_id!r} (threads: {threads})"
        )
    where = f"thread {req.thread_id!r}" if req.thread_id else "any thread"
    waited = sorted(
        {
            ev.req.name
            for t in state.threads
            if not req.thread_id or t.id == req.thread_id
            if t.status is _WAITING_EVENT
            for ev in t.wait_events
            if ev.status in ARMED
        }
    )
    waits = f"it waits for: {', '.join(waited)}" if waited else "it waits for no event now"
    raise CallbackNotFound(
        f"{where} of workflow {state.id} does not wait for {req.name!r}; {waits}"
    )
