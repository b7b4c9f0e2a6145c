"""One busy workflow's actor: applies its callbacks, resumes it, retries and fails it."""

from __future__ import annotations

import asyncio
import copy
import sqlite3
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import structlog
from structlog.contextvars import bind_contextvars

from daemon.clock import Clock
from daemon.core.engine import handle_callback, resume
from daemon.core.handler import CallbackRequest
from daemon.core.state import (
    FINAL_STATUSES,
    CheckpointType,
    EventStatus,
    State,
    ThreadStatus,
    WorkflowStatus,
)
from daemon.core.statements import Retry
from daemon.core.waits import teardown_ended
from daemon.core.workflow import Workflow
from daemon.errors import CallbackNotFound, HandlerRejected, Unavailable, WorkflowdError
from daemon.observe.metrics import Metrics
from daemon.runtime.arming import Arms
from daemon.runtime.cache import Cache, Loaded
from daemon.runtime.interrupt import Interruptible
from daemon.runtime.pipeline import Pipeline, Save
from daemon.runtime.pool import StepPool
from daemon.runtime.settings import Settings
from daemon.runtime.steps import StepRun
from daemon.runtime.work import Item, Reply
from daemon.store.base import Store, WorkflowLost

log = structlog.get_logger()
_DURABLE = (
    CheckpointType.AFTER_STEP,
    CheckpointType.AFTER_CONDITION,
    CheckpointType.STEPS_STARTED,
)
_FINAL_VALUES = frozenset(status.value for status in FINAL_STATUSES)
_BROKEN = (EventStatus.SETUP_ERROR, EventStatus.TEARDOWN_ERROR)
_EXECUTING = ThreadStatus.EXECUTING
#: Answers that cannot change after they are given.
_SCALARS = (type(None), bool, int, float, str, bytes)


@dataclass(eq=False, kw_only=True)
class Actor:
    """Drains one workflow's queue, then exits; waiting workflows have no actor.

    It gets the parts it uses, and nothing else: it never sees the runtime.
    """

    workflow_id: str
    store: Store
    cache: Cache
    arms: Arms
    clock: Clock
    settings: Settings
    limiter: anyio.CapacityLimiter
    #: Called when an ended workflow kept a wait whose teardown failed (the janitor retries it).
    on_leftover: Callable[[], None]
    #: Counts steps and callbacks for `/metrics`.
    metrics: Metrics | None = None
    #: Called once an end (finished, failed, cancelled) is durable: a parent may wait for it.
    on_ended: Callable[[str], None] = lambda workflow_id: None
    items: deque[Item] = field(default_factory=deque)
    #: Set once the actor has exited (a repair waits for it: see `wait_done`); made only
    #: when someone waits, not once per fired timer.
    _done: asyncio.Future[None] | None = None
    _exited: bool = False
    #: The steps in flight while the workflow resumes, for `show` and `list`.
    pool: StepPool | None = None
    #: What `interrupt` cancels: the retry wait, or the resume running now.
    _scope: anyio.CancelScope | Interruptible | None = None
    _interruptible: bool = False
    #: The current wait ends when work is queued (a broken wait's retry, not a step's).
    _takes_items: bool = False
    _cancelling: bool = False
    _stop: bool = False
    _history: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: Inbox events applied (or rejected) in memory since the last save.
    _unsaved: list[Item] = field(default_factory=list)
    _io_failures: int = 0
    #: The workflow in memory was moved on by a chain given up on: read it back first.
    _stale: bool = False
    _workflow: str = ""
    #: Another daemon took the workflow's lease (a shared store): nothing more is written.
    _lost: bool = False
    #: The resume running now reached an end: `_advance` saves it once resume returns.
    _end_due: bool = False
    #: The workflow the resume running now moves on (`_advance`).
    _resuming: Loaded | None = None
    #: This workflow's checkpoint writes, in order; steps run on while one commits.
    _pipeline: Pipeline = field(init=False)

    def __post_init__(self) -> None:
        self._pipeline = Pipeline(self._write, on_durable=self._durable)

    @property
    def busy(self) -> bool:
        """Tell whether the actor is working, rather than sleeping until a retry is due."""
        return not self._interruptible and not (self.pool is not None and self.pool.resting)

    def exited(self) -> None:
        """Note that the actor has exited, and wake whoever waits for that (the scheduler)."""
        self._exited = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def wait_done(self) -> None:
        """Return once the actor has exited."""
        if self._exited:
            return
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        # Shielded: a cancelled waiter must not cancel the future another waiter shares.
        await asyncio.shield(self._done)

    @property
    def committing(self) -> bool:
        """Tell whether the actor awaits a write in its own task: a cancel must wait for it."""
        pipeline = getattr(self, "_pipeline", None)  # gone once `run` ended
        return pipeline is not None and pipeline.committing

    @property
    def running(self) -> list[tuple[str, StepRun]]:
        """Return the steps running now, with their thread ids."""
        return list(self.pool.running.items()) if self.pool is not None else []

    def interrupt(self) -> None:
        """Stop the running step or retry wait because a cancel is coming."""
        self._cancelling = True
        if self._scope is not None:
            self._scope.cancel()

    def notify(self) -> None:
        """Tell the actor that work was queued: a cancel interrupts, a retry wait may end now."""
        if self.items and self.items[-1].kind == "cancel":
            # Also for one parked during a repair, whose sender could not interrupt us.
            self.interrupt()
        elif self._scope is not None and self._takes_items:
            self._scope.cancel()

    def stop_after_current(self) -> None:
        """Finish the running step, then stop (shutdown); a retry wait ends at once."""
        self._stop = True
        if self._scope is not None and self._interruptible:
            self._scope.cancel()
        if self.pool is not None:
            self.pool.stop()

    def lose(self) -> None:
        """Stop at once, writing nothing more: another daemon runs the workflow now."""
        self._lost = self._stop = True
        if self._scope is not None:
            self._scope.cancel()
        if self.pool is not None:
            self.pool.stop()

    def _dropped(self) -> None:
        """Drop the in-memory copy of a workflow whose lease another daemon took."""
        if not self._lost:
            log.warning("lease_lost", workflow_id=self.workflow_id)
        self.lose()
        self.arms.disarm_workflow(self.workflow_id)
        self.cache.forget(self.workflow_id)
        self._unsaved, self._history = [], []

    async def run(self) -> None:
        """Process queued items and resume the workflow until it blocks."""
        # Bound for good, not restored: an actor runs in a task (and a context) of its own, and
        # `bound_contextvars` copies the whole context twice, per actor, per fired timer.
        if self._stop:
            return  # stopped before it began: as `_load` would find
        loaded = self.cache.touch(self.workflow_id)  # `_load`'s common case, with no coroutine
        if loaded is not None:
            bind_contextvars(workflow_id=self.workflow_id, workflow=loaded.state.workflow)
        else:
            bind_contextvars(workflow_id=self.workflow_id)  # for what loading it may log
            loaded = await self._load()
            if loaded is None:
                return
            bind_contextvars(workflow=loaded.state.workflow)
        self._workflow = loaded.state.workflow
        try:
            await self._loop(loaded)
        finally:
            pipeline = self._pipeline
            if not pipeline.clean:  # the common end has nothing queued, in flight or lost
                await pipeline.settle()
                # A write that failed with nobody left to see it: its senders hear so.
                _fail_replies(pipeline.undurable(), "callback not stored: its write failed")
            if self.items:
                # Inbox-backed items stay in the store and are recovered on restart (or by
                # the daemon that took the workflow over).
                gone = "another daemon runs it now" if self._lost else "workflowd is shutting down"
                self._reject_all(Unavailable(gone))
            # The pipeline holds our bound methods: left as it is, every ended actor would be
            # garbage for the cyclic GC to find (an actor runs once, so nothing uses it after).
            del self._pipeline

    async def _loop(self, loaded: Loaded) -> None:
        while not self._stop:
            if self._stale:
                # A cancel gave up a chain of steps after its worker thread had moved the
                # state on: what the cancel checks is the durable state, not that.
                self._stale = False
                loaded = await self._guard(self._refresh, loaded)
                continue
            if self._cancelling:
                loaded = await self._guard(self._cancel, loaded)
                continue
            status = loaded.state.status
            if status in FINAL_STATUSES:
                if any(item.inbox_id is not None for item in self.items):
                    loaded = await self._guard(self._reject_late, loaded)
                    continue
                if self.items:  # no error made (an f-string and an exception) for nobody
                    self._reject_all(CallbackNotFound(f"workflow {self.workflow_id} is {status}"))
                return
            due = loaded.next_run_at
            if status is WorkflowStatus.RESUMING or due is not None:
                if due is None or due <= self.clock.now():
                    while self.items and self.items[0].kind == "resume":
                        self.items.popleft()  # this is the resume it asks for
                    # What `_guard` does, one coroutine frame fewer at each of the resume's
                    # suspensions (a step's worker, a commit): the common case, every item.
                    try:
                        await self._advance(loaded)
                    except Exception as e:  # noqa: BLE001 - handled as `_guard` handles it
                        loaded = await self._recover(loaded, e)
                        continue
                    self._io_failures = 0
                    loaded = self.cache.get(self.workflow_id) or loaded
                    continue
                # A step's retry holds its workflow; a broken wait's retry holds only itself:
                # its siblings' callbacks (and the rest of the queue) are taken meanwhile.
                takes_items = status is not WorkflowStatus.RESUMING
                if not (takes_items and self.items):
                    await self._sleep_until(due, takes_items=takes_items)
                    continue
            elif not self.items:
                return
            item = self.items.popleft()
            if item.kind == "callback":
                try:
                    await self._callback(loaded, item)
                except Exception as e:  # noqa: BLE001 - handled as `_guard` handles it
                    # The item is off the queue by now: nothing else would ever answer it.
                    if item.reply is not None:
                        item.reply.fail(_unexpected(e))
                    loaded = await self._recover(loaded, e)
                    continue
                self._io_failures = 0
                loaded = self.cache.get(self.workflow_id) or loaded
            elif item.kind == "resume":
                loaded.next_run_at = self.clock.now()  # resume once (e.g. to retry a setup)
            elif item.kind == "cancel":
                self.items.appendleft(item)
                self._cancelling = True
            elif item.kind == "listen_failed":
                loaded = await self._guard(self._listen_failed, loaded, item)

    async def _guard(self, fn: Any, loaded: Loaded, *args: Any) -> Loaded:
        """Run one unit of work; an I/O failure reloads the durable state and backs off."""
        try:
            await fn(loaded, *args)
        except Exception as e:  # noqa: BLE001 - e.g. disk full: never crash, back off and retry
            return await self._recover(loaded, e)
        self._io_failures = 0
        return self.cache.get(self.workflow_id) or loaded

    async def _recover(self, loaded: Loaded, e: Exception) -> Loaded:
        """Handle a unit of work that raised: back off and read the durable state back."""
        if isinstance(e, WorkflowLost):
            self._dropped()
            return loaded
        await self._back_off(e)
        fresh = await self._load()
        if fresh is None:
            self._stop = True  # gone from the store, or stopping: nothing left to do
            return loaded
        status = fresh.state.status
        if status is not WorkflowStatus.RESUMING and status not in FINAL_STATUSES:
            fresh.next_run_at = self.clock.now()  # resume once to finish setup
        self.arms.rearm(fresh.wf, fresh.state)
        return fresh

    async def _load(self) -> Loaded | None:
        """Load the workflow, retrying a failing read; None if it cannot run (callers told why)."""
        while not self._stop:
            try:
                return await self.cache.load(self.workflow_id)
            except WorkflowdError as e:
                self._reject_all(e)
                return None
            except Exception as e:  # noqa: BLE001 - e.g. an I/O error: back off and retry
                await self._back_off(e)
        return None

    async def _back_off(self, e: Exception) -> None:
        """Log a failure, forget what was not saved, and wait before trying again."""
        self._io_failures += 1
        delay = self._backoff(self._io_failures, None)
        event = "checkpoint_failed" if isinstance(e, sqlite3.Error | OSError) else "workflow_error"
        log.error(event, error=f"{type(e).__name__}: {e}", retry_in_s=delay)
        # Callers waiting for an answer get an error now rather than after the disk (or the
        # lock) comes back.
        self._reject_waiting(Unavailable(f"cannot save workflow state: {type(e).__name__}: {e}"))
        # The write in flight lands (or fails) before the durable state is read back.
        await self._pipeline.settle()
        # Inbox events taken since the last durable save are acknowledged but not applied:
        # they go back to the front of the queue, in order, so none is stranded or overtaken.
        # A waiting sender's callback in a lost write was not acknowledged: it hears so, and
        # its event is dropped (it may send again).
        lost = self._pipeline.undurable()
        _fail_replies(lost, f"callback not stored: {type(e).__name__}: {e}")
        kept = [item for item in lost if item.inbox_id is not None]
        self.items.extendleft(reversed([*kept, *self._unsaved]))
        self._unsaved = []
        self.cache.forget(self.workflow_id)
        self._history.clear()
        await self._sleep_until(self.clock.now() + delay)

    async def _sleep_until(self, deadline: float, *, takes_items: bool = False) -> None:
        with anyio.CancelScope() as self._scope:
            self._interruptible, self._takes_items = True, takes_items
            await self.clock.sleep_until(deadline)
        self._scope, self._interruptible, self._takes_items = None, False, False

    def _take(self, loaded: Loaded, data: str | None = None) -> Save:
        """Return the checkpoint of the workflow as it is now, with the history noted so far.

        `data` is the workflow's data as JSON, if the caller has it already.
        """
        if loaded.state.status is WorkflowStatus.FINISHED:
            # A step retried on the way (its error kept until the resume ends) is over: a
            # Finished workflow carries no error, also if the daemon dies before _settle.
            loaded.attempt, loaded.error, loaded.next_run_at = 0, None, None
        # Taken now: steps still running note their history meanwhile, for the next save.
        history, self._history = self._history, []
        items, self._unsaved = self._unsaved, []
        # Steps run in a chain (see StepPool) since the last one are checkpointed by this one.
        chained = self.pool.take_chained() if self.pool is not None else 0
        return Save(
            status=loaded.state.status.value,
            data=loaded.wf.to_json() if data is None else data,
            state=loaded.state.to_json(),
            error=loaded.error,
            attempt=loaded.attempt,
            next_run_at=loaded.next_run_at,
            history=history,
            items=items,
            count=1 + chained,
        )

    async def _write(self, save: Save) -> None:
        await self.store.checkpoint(
            self.workflow_id,
            status=save.status,
            data=save.data,
            state=save.state,
            error=save.error,
            attempt=save.attempt,
            next_run_at=save.next_run_at,
            history=save.history,
            inbox_done=save.inbox_done,
        )

    def _durable(self, save: Save) -> None:
        for item in save.items:
            # A sender that waits for this commit (see `_callback`).
            if item.reply is not None and item.reply.release() and self.metrics is not None:
                self.metrics.callback("applied")
        if save.status in _FINAL_VALUES:  # a string compare: no enum made per write
            self.on_ended(self.workflow_id)

    async def _save(self, loaded: Loaded, data: str | None = None) -> None:
        """Save the workflow and return once it is durable, with every checkpoint before it."""
        if self._scope is None:
            # Nothing may interrupt us now but shutdown, which waits for the write (see
            # `committing`): it is awaited here, without a task of its own.
            await self._pipeline.commit(self._take(loaded, data))
            return
        if self._pipeline.queue(self._take(loaded, data)):
            await self._pipeline.room_taken()
        await self._pipeline.flush()

    async def _put(self, loaded: Loaded) -> None:
        if self._pipeline.queue(self._take(loaded)):
            await self._pipeline.room_taken()

    async def _put_resuming(self) -> None:
        """Put a checkpoint of the workflow the resume running now moves on (see StepPool)."""
        assert self._resuming is not None
        await self._put(self._resuming)

    async def _refresh(self, loaded: Loaded) -> None:
        await self._reload()

    async def _flush(self) -> None:
        await self._pipeline.flush()

    async def _checkpoint(self, kind: CheckpointType) -> None:
        """Take the engine's checkpoint of the workflow the resume running now moves on."""
        # Resume transitions are a pure function of data and state, so only what follows a
        # side effect must be durable at once; the rest is written when resume returns.
        if kind not in _DURABLE:
            return
        loaded = self._resuming
        assert loaded is not None
        # The next step need not wait for this commit: nothing outside has seen its effect yet.
        # Anything that tells the outside (a reply, an end, a command) flushes first. Only when
        # no step is about to run and the workflow goes on may the engine set up waits (a
        # child's start, a listener) right after this: then it is durable first. An end is
        # written by the save that settles it once resume returns (`_advance`): taken here, it
        # would be encoded only to be merged into that one.
        if loaded.state.status in FINAL_STATUSES:
            self._end_due = True
            return
        pool = self.pool
        if pool is not None and pool.stepping:
            # Held back a moment: when the step is quick, the save after it merges into this
            # write (a fired timer's resume: one commit, not two). Nothing waits for it.
            if self._pipeline.queue(self._take(loaded), hold=True):
                await self._pipeline.room_taken()
        else:
            await self._save(loaded)

    async def _on_retry(self, detail: dict[str, Any], attempt: int, error: str, due: float) -> None:
        assert self._resuming is not None
        await self._retry_due(self._resuming, detail, attempt, error, due)

    async def _advance(self, loaded: Loaded) -> None:
        loaded.next_run_at, self._end_due = None, False
        # What the engine's checkpoints and the pool's callbacks save: bound methods reading
        # it, not closures made per resume.
        self._resuming = loaded
        # Failed attempts stored before a restart count for the threads that were running.
        attempts = (
            {t.id: loaded.attempt for t in loaded.state.threads if t.status is _EXECUTING}
            if loaded.attempt
            else None
        )
        # Taken off the workflow while the resume runs: steps change the data.
        defn, cls = loaded.definition(), type(loaded.wf)
        loaded.keep(None)

        # Not an anyio CancelScope: the first in a task costs ~10 µs, once per resume.
        async with Interruptible() as self._scope:
            try:
                pool = self.pool = StepPool(
                    limiter=self.limiter,
                    clock=self.clock,
                    settings=self.settings,
                    note=self._note,
                    on_retry=self._on_retry,
                    attempts=attempts,
                    observe=self._observe_step,
                    durable=self._flush,
                    room=self._pipeline.room,
                    save=self._put_resuming,
                )
                try:
                    if self._stop:  # shutdown began while this resume was being set up
                        pool.stop()
                    defn = await resume(
                        loaded.wf,
                        loaded.state,
                        self._checkpoint,
                        steps=pool,
                        on_conflict=self._conflict,
                        definition=defn,
                    )
                finally:
                    # `async with pool`, less its two calls when no step ran in a task.
                    if pool.grouped:
                        await pool.__aexit__(None, None, None)
            except WorkflowLost:
                raise  # not a failure of the workflow: another daemon runs it now
            except WorkflowdError as e:  # StepFailed (for good) among them
                await self._fail(await self._reload(), str(e))
                return
            finally:
                self._stale = self._stale or (self.pool is not None and self.pool.stale)
                self.pool = self._resuming = None
        self._scope = None
        if type(loaded.wf) is cls:  # a reload may have switched its class meanwhile
            loaded.keep(defn)
        end_due, self._end_due = self._end_due, False
        if self._cancelling or self._lost:
            if end_due and not self._lost:
                # Ended before the cancel came: what the cancel answers is that end, durable.
                await self._put(loaded)
            return
        if loaded.state.status is WorkflowStatus.FINISHED:
            self._history.append(("finished", {}))
        await self._settle(loaded)
        if loaded.state.status is WorkflowStatus.FINISHED:
            log.info("workflow_finished")
            if loaded.state.threads:  # a wait whose teardown failed: retried by the janitor
                self.on_leftover()

    async def _settle(self, loaded: Loaded) -> None:
        """Save the workflow and arm its waits; broken waits log and set the next retry."""
        broken = [
            ev.error for t in loaded.state.threads for ev in t.wait_events if ev.status in _BROKEN
        ]
        if broken and loaded.state.status not in FINAL_STATUSES:
            loaded.attempt += 1
            delay = self._backoff(loaded.attempt, None)
            loaded.error, loaded.next_run_at = "; ".join(broken), self.clock.now() + delay
            log.warning("handler_failed", error=loaded.error, retry_in_s=delay)
        else:
            loaded.attempt, loaded.error = 0, None
        # What `_save` does, one coroutine frame fewer; outside the resume's interruptible
        # block, so the write is awaited right here (see Pipeline.commit).
        await self._pipeline.commit(self._take(loaded))
        loaded.keep(self.arms.rearm(loaded.wf, loaded.state, loaded.definition()))

    async def _listen_failed(self, loaded: Loaded, item: Item) -> None:
        """Record an armed wait whose listener failed as a setup error, retried with backoff."""
        assert item.req is not None
        req = item.req
        for t in loaded.state.threads:
            for ev in t.wait_events:
                if (
                    t.id == req.thread_id
                    and ev.req.name == req.name
                    and ev.req.pc == req.pc
                    and ev.status is EventStatus.SETUP
                ):
                    # Setup runs again at the retry, as for a setup that failed; the stored
                    # setup data stays, so the handler may take up what it had seen.
                    ev.status, ev.error = EventStatus.SETUP_ERROR, str(item.input)
                    await self._settle(loaded)
                    return
        # The wait was handled, torn down or set up again meanwhile: nothing to record.

    def _note(self, kind: str, detail: dict[str, Any]) -> None:
        self._history.append((kind, detail))

    def _observe_step(self, step: str, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.step(self._workflow, step, outcome, seconds)

    def _conflict(self, path: str, step: str, thread_id: str) -> None:
        field = path.split(".", 1)[0].split("[", 1)[0]
        log.warning("step_merge_conflict", field=field, path=path, step=step, thread=thread_id)
        self._note("step_merge_conflict", {"field": field, "path": path, "step": step})

    async def _retry_due(
        self, loaded: Loaded, detail: dict[str, Any], attempt: int, error: str, due: float
    ) -> None:
        """Store that a thread's step failed and when it runs again; the others go on."""
        loaded.attempt, loaded.error = attempt, error
        await self._pipeline.flush()  # after the checkpoints taken before it
        # The history noted so far goes first, so entries keep their order.
        history, self._history = [*self._history, ("step_failed", detail)], []
        await self.store.set_status(
            self.workflow_id,
            status=loaded.state.status.value,
            error=error,
            attempt=attempt,
            next_run_at=due,
            history=history,
        )
        self._history = []

    def _backoff(self, attempt: int, policy: Retry | None) -> float:
        if policy is None:
            return self.settings.backoff(attempt)
        return self.settings.backoff(attempt, policy.initial_s, policy.max_s)

    async def _reload(self) -> Loaded:
        await self._pipeline.flush()  # the durable state is the one read back
        return await self.cache.reload(self.workflow_id)

    async def _end(
        self, loaded: Loaded, status: WorkflowStatus, error: str | None, by: Any = None
    ) -> None:
        """Finish a workflow as failed or cancelled, tearing down every wait."""
        loaded.state.status, loaded.error, loaded.next_run_at = status, error, None
        self.arms.disarm_workflow(self.workflow_id)
        left = await teardown_ended(loaded.wf, loaded.state)
        detail: dict[str, Any] = {"error": error}
        if by is not None:
            detail["by"] = by
        self._history.append((status.value.lower(), detail))
        await self._save(loaded)
        if left:
            self.on_leftover()

    async def _fail(self, loaded: Loaded, error: str) -> None:
        await self._end(loaded, WorkflowStatus.FAILED, error)
        log.error("workflow_failed", error=error)

    async def _cancel(self, loaded: Loaded) -> None:
        self._cancelling = False
        cancels = [i for i in self.items if i.kind == "cancel"]
        for item in cancels:
            self.items.remove(item)
        # A cancel may say why (a deadline that passed) and who asked (the dashboard).
        asked = [i.input for i in cancels if isinstance(i.input, dict)]
        why = next((str(a["error"]) for a in asked if a.get("error") is not None), None)
        by = next((a["by"] for a in asked if a.get("by") is not None), None)
        try:
            await self._pipeline.flush()  # the status answered is a durable one
            if loaded.state.status not in FINAL_STATUSES:
                loaded = await self._reload()
                await self._end(loaded, WorkflowStatus.CANCELLED, why, by)
                log.info("workflow_cancelled", **({"error": why} if why else {}))
        except Exception as e:
            for item in cancels:  # they may ask again once the store works
                if item.reply is not None:
                    item.reply.fail(Unavailable(f"cancel not stored: {type(e).__name__}: {e}"))
            raise
        for item in cancels:
            if item.reply is not None:
                item.reply.set({"status": loaded.state.status.value})

    async def _callback(self, loaded: Loaded, item: Item) -> None:
        assert item.req is not None
        reply = item.reply  # a fired timer has none, and none is made for it
        event = item.req.name
        defn = loaded.definition()
        loaded.keep(None)  # the handler changes the data
        try:
            before = loaded.wf.snapshot()
        except (msgspec.MsgspecError, TypeError, ValueError, RecursionError):
            before = None  # data that no longer encodes: the full check below says why
        try:
            out = await handle_callback(
                item.req, loaded.wf, loaded.state, item.input, definition=defn
            )
        except WorkflowdError as e:
            await self._reject(loaded, item, reply, e)
            return
        try:
            data = _check_fits(loaded.wf, before)
        except HandlerRejected as e:
            # The handler stored what the data fields cannot hold (a float in an int field):
            # saved, the row would no longer load. Start again from the durable state.
            await self._reject(await self._reload(), item, reply, e)
            return
        if item.inbox_id is not None:
            self._unsaved.append(item)
        if loaded.state.status is WorkflowStatus.RESUMING:
            loaded.next_run_at = None  # go on now, even if a broken wait was due a retry later
        received: dict[str, Any] = {"event": event}
        thread = _thread_at(loaded.state, None, ThreadStatus.RESUMING, callback=event)
        if thread:
            received["thread"] = thread
        self._history.append(("callback_received", received))
        loaded.keep(self.arms.rearm(loaded.wf, loaded.state))
        if _rides_along(item, loaded):
            if item.reply is None and item.inbox_id is None:
                _log_received(event, item.req)
                # A fired timer has no sender to answer: it is saved with the resume that
                # follows (its re-arm included), one commit. A crash before that leaves it
                # armed in the store, so it fires again, once.
                if self.metrics is not None:
                    self.metrics.callback("applied")
                return
            # One commit for the callback and the resume it starts: its checkpoint is queued,
            # not awaited, and issued by the resume's first checkpoint (a step starting: the
            # step then runs while it commits) or merged into the save that settles the
            # resume, written in this task (no task per callback for the write). The sender
            # is answered once that write is durable (`_durable`), so a step the resume
            # starts never holds the answer back. If it fails, `_back_off` answers it.
            if item.reply is not None:
                # The answer as it is now: the resume runs before it is sent, and a handler
                # may answer with part of the data (a list a step then appends to).
                item.reply.keep(_frozen(out))
                if item.inbox_id is None:
                    self._unsaved.append(item)
            elif self.metrics is not None:
                self.metrics.callback("applied")
            if self._pipeline.queue(self._take(loaded, data), defer=True):
                await self._pipeline.room_taken()
            # Logged once the save is taken: the log thread this wakes renders while the
            # resume runs and the writer commits.
            _log_received(event, item.req)
            return
        _log_received(event, item.req)
        try:
            await self._save(loaded, data)
        except Exception as e:
            if reply is not None:
                reply.fail(Unavailable(f"callback not stored: {type(e).__name__}: {e}"))
            raise
        if self.metrics is not None:
            self.metrics.callback("applied")
        if reply is not None:
            reply.set(out)

    async def _reject(
        self, loaded: Loaded, item: Item, reply: Reply | None, e: WorkflowdError
    ) -> None:
        assert item.req is not None
        event = item.req.name
        log.info("callback_rejected", event_name=event, code=e.code, error=str(e))
        if self.metrics is not None:
            self.metrics.callback("rejected")
        if reply is not None:
            reply.fail(e)
        if item.inbox_id is not None:
            self._unsaved.append(item)
            self._history.append(("callback_rejected", {"event": event, "error": str(e)}))
            await self._save(loaded)

    async def _reject_late(self, loaded: Loaded) -> None:
        """Reject the inbox events queued for a workflow that has ended, and drop their rows."""
        # Acknowledged before the end, they can apply to nothing now; without this they would
        # stay in the inbox and be replayed (and refused) after every restart.
        error = CallbackNotFound(f"workflow {self.workflow_id} is {loaded.state.status}")
        for item in [i for i in self.items if i.inbox_id is not None]:
            assert item.req is not None
            self.items.remove(item)
            log.info(
                "callback_rejected", event_name=item.req.name, code=error.code, error=str(error)
            )
            self._unsaved.append(item)
            self._history.append(
                ("callback_rejected", {"event": item.req.name, "error": str(error)})
            )
        await self._save(loaded)

    def _reject_waiting(self, error: WorkflowdError) -> None:
        for item in [i for i in self.items if i.kind == "callback" and i.inbox_id is None]:
            if item.reply is not None:
                self.items.remove(item)
                item.reply.fail(error)

    def _reject_all(self, error: WorkflowdError) -> None:
        while self.items:
            item = self.items.popleft()
            if item.reply is not None:
                item.reply.fail(error)


def _log_received(event: str, req: CallbackRequest) -> None:
    log.info("callback_received", event_name=event, thread=req.thread_id or None)


def _unexpected(e: Exception) -> WorkflowdError:
    """Return the error to answer a request with when `e` broke its handling."""
    if isinstance(e, WorkflowdError):
        return e
    if isinstance(e, sqlite3.Error | OSError):
        return Unavailable(f"cannot save workflow state: {type(e).__name__}: {e}")
    return WorkflowdError(f"{type(e).__name__}: {e}")


def _rides_along(item: Item, loaded: Loaded) -> bool:
    """Tell whether a callback's save may go in one commit with the resume it starts."""
    return loaded.state.status is WorkflowStatus.RESUMING and loaded.next_run_at is None


def _frozen(value: Any) -> Any:
    """Return a copy of `value` that later changes to the workflow's data cannot reach."""
    if isinstance(value, _SCALARS):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is answered as it is
        return value


def _fail_replies(items: list[Item], why: str) -> None:
    """Answer the senders of `items` who still wait with `unavailable`."""
    for item in items:
        if item.reply is not None:
            item.reply.fail(Unavailable(why))


def _check_fits(wf: Workflow, before: bytes | None = None) -> str:
    """Return the data as JSON; raise HandlerRejected unless it round-trips through its types.

    `before` is the data as encoded before the handler ran, if known: data the handler left
    as it was still fits (it was decoded through these types, or checked so, when it came in).
    """
    try:
        data = wf.snapshot()
        # Decoding through the types costs ~10x the encode: done only when the handler wrote
        # something, and without from_json's fill_defaults (a walk of the data in Python that
        # only fills in the decoded copy, which is thrown away).
        if data != before:
            msgspec.json.decode(data, type=type(wf))
        return data.decode()
    except (msgspec.MsgspecError, TypeError, ValueError, RecursionError) as e:
        # RecursionError: data nested too deeply (or holding itself) to be saved.
        raise HandlerRejected(f"the input does not fit {type(wf).__name__}'s fields: {e}") from e


def _thread_at(
    state: State, step: str | None, status: ThreadStatus, *, callback: str | None = None
) -> str | None:
    """Return the id of the thread at `step` (or just past `callback`) with `status`, if any."""
    for t in state.threads:
        at = step is None or t.cur_step == step
        if t.status is status and at and callback in (None, t.cur_callback):
            return t.id
    return None
