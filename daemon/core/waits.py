"""A thread's waits: releasing them, and the one loop that tears their handlers down."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container

from daemon.core.definition import Definable, Definition
from daemon.core.handler import Handler
from daemon.core.state import (
    RELEASED,
    TEARDOWN_DUE,
    CheckpointType,
    EventStatus,
    State,
    Thread,
    WaitEvent,
    WorkflowStatus,
)
from daemon.core.statements import On
from daemon.errors import StepNotFound

#: Called after each successful teardown (the engine checkpoints there).
AfterEach = Callable[[CheckpointType], Awaitable[None]]


async def teardown_waits(
    state: State,
    handler_of: Callable[[WaitEvent], Handler],
    checkpoint: AfterEach | None = None,
    *,
    keep: Container[tuple[str, str, int]] = (),
) -> int:
    """Tear down every wait due for it, except those in `keep`; return how many failed.

    The one teardown loop: `resume`, the end of a workflow, the janitor and `undo` all use it.
    A failure (the handler raised, or `handler_of` found no handler) is recorded on the wait,
    not raised: the thread can go on and the teardown is retried later.
    """
    failed = 0
    for t in state.threads:
        for ev in list(t.wait_events):
            if ev.status not in TEARDOWN_DUE or (keep and (t.id, ev.req.name, ev.req.pc) in keep):
                continue
            try:
                await handler_of(ev).teardown(ev.req, ev.handled)
            except Exception as e:  # noqa: BLE001 - any handler failure is recorded
                ev.status, ev.error = EventStatus.TEARDOWN_ERROR, describe(e)
                failed += 1
                continue
            t.wait_events.remove(ev)
            if checkpoint is not None:
                await checkpoint(CheckpointType.AFTER_TEARDOWN)
    return failed


def handlers_of(wf: Definable) -> Callable[[WaitEvent], Handler]:
    """Return a lookup of each wait's handler in `wf`'s current definition.

    A definition that cannot be built leaves every lookup failing, so the waits stay recorded
    as teardown errors (to be retried once the code is fixed).
    """
    try:
        events: dict[str, On] = Definition(wf.definition()).events
    except Exception as e:  # noqa: BLE001 - user code: recorded on each wait instead
        broken = describe(e)
        events = {}
    else:
        broken = ""

    def lookup(ev: WaitEvent) -> Handler:
        on = events.get(ev.req.name)
        if on is None:
            why = f": the definition cannot be built: {broken}" if broken else ""
            raise StepNotFound(f"event {ev.req.name!r} is not in the definition{why}")
        return on.handler

    return lookup


async def teardown_ended(wf: Definable, state: State) -> int:
    """Tear down every wait left on an ended workflow; return how many still fail."""
    release_waits(state)
    failed = await teardown_waits(state, handlers_of(wf))
    drop_ended_threads(state)
    return failed


def drop_ended_threads(state: State) -> None:
    # Threads end with a finished workflow; ones whose teardown failed stay to be retried.
    if state.status is WorkflowStatus.FINISHED:
        state.threads = [t for t in state.threads if t.wait_events]


def describe(e: BaseException) -> str:
    """Return an exception as the error text stored on a wait."""
    return f"{type(e).__name__}: {e}"


def release_waits(state: State) -> None:
    """Mark every armed wait of every thread for teardown (the workflow ended or was cancelled)."""
    for t in state.threads:
        release_thread(t)


def release_thread(t: Thread) -> None:
    """Mark a thread's armed waits for teardown; drop those never set up (nothing to undo)."""
    kept = []
    for ev in t.wait_events:
        if ev.status is not EventStatus.PENDING_SETUP:
            if ev.status in RELEASED:
                ev.status = EventStatus.PENDING_TEARDOWN
            kept.append(ev)
    t.wait_events = kept
