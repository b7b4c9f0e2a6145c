"""The workflow engine: state, `resume` and `handle_callback`; pure, no I/O of its own."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

# Explicit re-exports (mypy's idiom): daemon.core.engine.Definition and .validate stay importable.
from daemon.core.definition import Definable, dispatch_entry
from daemon.core.definition import Definition as Definition  # noqa: PLC0414
from daemon.core.definition import validate as validate  # noqa: PLC0414
from daemon.core.handler import CallbackRequest, Handler
from daemon.core.state import (
    ARMED,
    FINAL_STATUSES,
    MAIN_THREAD,
    RUNNABLE,
    SETUP_DUE,
    CheckpointType,
    EventStatus,
    State,
    Thread,
    ThreadStatus,
    WaitEvent,
    WorkflowStatus,
)
from daemon.core.statements import (
    Break,
    Continue,
    For,
    Go,
    If,
    On,
    Return,
    Section,
    Step,
    Stmt,
    Switch,
    Wait,
    WaitFor,
    _Branching,
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

# Enum members read on every transition (an Enum class attribute costs ~0.1 µs in 3.11).
_EXECUTING, _RESUMING = ThreadStatus.EXECUTING, ThreadStatus.RESUMING
_WAITING_EVENT, _WAITING_CONDITION = ThreadStatus.WAITING_EVENT, ThreadStatus.WAITING_CONDITION
_PENDING_SETUP, _SETUP = EventStatus.PENDING_SETUP, EventStatus.SETUP
_AFTER_STEP, _AFTER_RESUME = CheckpointType.AFTER_STEP, CheckpointType.AFTER_RESUME

#: Transitions one `resume` may make before the workflow is declared a runaway.
MAX_TRANSITIONS = 10_000


Checkpoint = Callable[[CheckpointType], Awaitable[None]]
StepRunner = Callable[[Step], Awaitable[None]]


async def call_action(fn: Callable[[], object]) -> object:
    """Call a sync or async zero-argument callable."""
    result = fn()
    if result is not None and inspect.isawaitable(result):
        return await result
    return result


async def _run_step(step: Step) -> None:
    await call_action(step.action)


_BREAK, _CONTINUE, _RETURN = object(), object(), object()
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
        return (_RUN.get(type(stmt)) or dispatch_entry(_RUN, stmt))(self, stmt)

    def section(self, stmt: Section) -> _Stop:
        for s in stmt.stmts:
            stop = (_RUN.get(type(s)) or dispatch_entry(_RUN, s))(self, s)
            if stop is not None:
                return stop
        return None

    def _leaf(self, stmt: Step | WaitFor) -> _Stop:
        if self.running:
            return stmt
        if self.thread.cur_step == stmt.name:
            self.running = True
        return None

    def _jump(self, stmt: Stmt) -> _Stop:
        return _JUMPS[type(stmt)] if self.running else None

    def _branch(self, stmt: _Branching) -> _Stop:
        if self.running:
            for b in stmt.branches:
                if b.default or truth(b.cond):
                    return self.section(b.body)
            return None
        for b in stmt.branches:
            if self.thread.cur_step == b.name:
                self.running = True
                return self.section(b.body)
            stop = self.section(b.body)
            if stop is not None or self.running:
                return stop
        return None

    def _loop(self, stmt: For) -> _Stop:
        if not self.running:
            if self.thread.cur_step == stmt.name:
                self.running = True
            else:
                stop = self.section(stmt.body)
                if not self.running:
                    return None
                if stop is _BREAK:
                    return None
                if stop is not None and stop is not _CONTINUE:
                    return stop
        while truth(stmt.cond):
            self.resumer.tick(self.thread)
            stop = self.section(stmt.body)
            if stop is _BREAK:
                return None
            if stop is not None and stop is not _CONTINUE:
                return stop
        return None

    def _wait(self, stmt: Wait) -> _Stop:
        if self.running:
            return stmt
        t = self.thread
        if t.cur_step == stmt.name:
            self.running = True
            if not t.cur_callback:
                return stmt
            for case in stmt.cases:
                if case.event == t.cur_callback:
                    t.cur_callback = ""
                    return self.section(case.body)
            raise StepNotFound(
                f"thread {t.id}: wait {stmt.name!r} has no case {t.cur_callback!r} any more"
            )
        for c in stmt.cases:
            stop = self.section(c.body)
            if stop is not None or self.running:
                return stop
        return None

    def _go(self, stmt: Go) -> _Stop:
        if not self.running:
            return None
        tid, state = stmt.thread_id, self.resumer.state
        if state.thread(tid) is not None:
            raise WorkflowdError(f"thread {tid!r} is already running (give Go an id= per loop)")
        state.threads.append(Thread(tid, stmt.name))
        return None


_JUMPS: dict[type[Stmt], object] = {Break: _BREAK, Continue: _CONTINUE, Return: _RETURN}
_RUN: dict[type[Stmt], Callable[[_Cursor, Any], _Stop]] = {
    Section: _Cursor.section,
    _Branching: _Cursor._branch,
    Step: _Cursor._leaf,
    WaitFor: _Cursor._leaf,
    If: _Cursor._branch,
    Switch: _Cursor._branch,
    For: _Cursor._loop,
    Wait: _Cursor._wait,
    Go: _Cursor._go,
    Break: _Cursor._jump,
    Continue: _Cursor._jump,
    Return: _Cursor._jump,
}


class _Resumer:
    """One `resume` call: the definition is rebuilt only after the data may have changed."""

    def __init__(self, wf: Definable, state: State, checkpoint: Checkpoint):
        self.wf, self.state, self.checkpoint = wf, state, checkpoint
        self.root = wf.definition()
        # Validated once per call, as the seed does; rebuilds are indexed only when needed.
        self._defn: Definition | None = Definition(self.root)
        # What cursors stopped at in the current tree, so most lookups need no index:
        # the Step each thread runs next (by thread id) and the cases of Waits (by event).
        self.ready: dict[str, Step] = {}
        self.cases: dict[str, On] = {}
        self.budget = MAX_TRANSITIONS

    @property
    def defn(self) -> Definition:
        """Return the current tree, indexed (and validated) on first use."""
        if self._defn is None:
            self._defn = Definition(self.root)
        return self._defn

    def rebuild(self) -> None:
        # Most rebuilds are only walked by a cursor, so indexing waits until a lookup needs it.
        self.root = self.wf.definition()
        self._defn = None
        self.ready.clear()
        self.cases.clear()

    def tick(self, t: Thread) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise RunawayWorkflow(
                f"workflow {self.state.id} made {MAX_TRANSITIONS} transitions without "
                f"blocking (thread {t.id} near {t.cur_step!r}); endless loop?"
            )

    def runnable(self) -> Thread | None:
        for t in self.state.threads:
            if t.status in RUNNABLE:
                return t
        return None

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
        self.rebuild()

    def advance(self, t: Thread) -> None:
        """Move `t` on to where it must stop; the caller checkpoints (AFTER_RESUME)."""
        s = self.state
        if t.name == MAIN_THREAD:
            body: Section = self.root
        elif (go := self.defn.get(t.name, Go)) is not None:
            body = go.body
        else:
            raise StepNotFound(f"thread {t.id}: Go {t.name!r} is not in the definition")
        cursor = _Cursor(self, t)
        t.pc += 1
        s.pc += 1
        stop = cursor.run(body)
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

    def handler(self, ev: WaitEvent) -> Handler:
        on = self.cases.get(ev.req.name) or self.defn.get(ev.req.name, On)
        if on is None:
            raise StepNotFound(f"event {ev.req.name!r} is not in the definition")
        return on.handler


async def resume(
    wf: Definable, state: State, checkpoint: Checkpoint, *, run_step: StepRunner = _run_step
) -> None:
    """Run the workflow until every thread is blocked or it has finished."""
    if state.status in FINAL_STATUSES:
        raise WorkflowdError(f"workflow {state.id} is already {state.status}")
    r = _Resumer(wf, state, checkpoint)
    state.pc += 1
    await r.teardown()
    while state.status not in FINAL_STATUSES:
        t = r.runnable()
        if t is not None:
            r.tick(t)
            if t.status is _EXECUTING:
                step = r.step_of(t)
                try:
                    await run_step(step)
                except Exception as e:
                    raise StepFailed(step.name, e) from e
                r.stepped(t)
                await checkpoint(_AFTER_STEP)
            else:
                r.advance(t)
                await checkpoint(_AFTER_RESUME)
        elif not await r.check_conditions():
            break
    if state.status in FINAL_STATUSES:
        await r.teardown()
        drop_ended_threads(state)
    await r.setup()
    state.update_status()


async def handle_callback(req: CallbackRequest, wf: Definable, state: State, input: Any) -> Any:
    """Apply an event to the thread waiting for it and return the handler's output."""
    defn = Definition(wf.definition())
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
