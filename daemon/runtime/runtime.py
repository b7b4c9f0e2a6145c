"""The runtime: starts, resumes and recovers workflows, one actor per busy workflow."""

from __future__ import annotations

import builtins
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc
import msgspec
import structlog

from daemon.clock import Clock, get_clock, use_clock
from daemon.core.engine import Definition
from daemon.core.handler import CallbackRequest
from daemon.core.lint import log_findings
from daemon.core.state import FINAL_STATUSES, EventStatus, State, WorkflowStatus
from daemon.core.workflow import Workflow
from daemon.errors import (
    CallbackNotFound,
    Conflict,
    Unavailable,
    UnknownWorkflowType,
    WorkflowError,
    WorkflowNotFound,
)
from daemon.ops import repairs as repair
from daemon.runtime.actor import Actor, Item, Loaded, Reply
from daemon.runtime.arming import Arms
from daemon.runtime.janitor import Janitor
from daemon.store.sqlite import Store, WorkflowRow

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Settings:
    """The runtime's tunables (the `[runtime]` section of the config)."""

    max_concurrent_steps: int = 64
    retry_initial_s: float = 1.0
    retry_max_s: float = 300.0
    #: 0 retries forever.
    retry_max_attempts: int = 0
    #: Workflows kept loaded in memory after their actor went idle.
    cache_size: int = 10_000
    #: Start with every workflow held (`workflowd --hold`) until released.
    hold: bool = False
    #: What `gc` keeps by default (`[store] keep_finished_days`; 0: retention off).
    keep_finished_days: float = 30.0


class LogSource(Protocol):
    """What the runtime needs of the log hub to serve `logs`."""

    def recent(self, workflow_id: str | None = None) -> builtins.list[dict[str, Any]]:
        """Return the buffered records."""
        ...

    def subscribe(
        self, workflow_id: str | None = None
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Stream buffered, then live, records."""
        ...


@asynccontextmanager
async def _replay(
    records: builtins.list[dict[str, Any]],
) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    async def each() -> AsyncIterator[dict[str, Any]]:
        for record in records:
            yield record

    yield each()


class Runtime:
    """Runs every workflow of one store; the control socket calls its public methods."""

    def __init__(
        self,
        store: Store,
        registry: dict[str, type[Workflow]],
        settings: Settings,
        tg: anyio.abc.TaskGroup,
        clock: Clock,
        logs: LogSource | None = None,
    ) -> None:
        self.store, self.registry, self.settings, self.clock = store, registry, settings, clock
        self.tg = tg
        self.logs = logs
        self.limiter = anyio.CapacityLimiter(settings.max_concurrent_steps)
        self.arms = Arms(tg, clock, self._submit_callback)
        self.actors: dict[str, Actor] = {}
        self.cache: OrderedDict[str, Loaded] = OrderedDict()
        self.stopping = False
        self.hold = repair.Hold(settings.hold)
        self.janitor = Janitor(self)
        self._idle = anyio.Event()
        self._idle.set()

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        store: Store,
        registry: dict[str, type[Workflow]],
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
        logs: LogSource | None = None,
    ) -> AsyncIterator[Runtime]:
        """Run a runtime (recovering every unfinished workflow) until the block exits."""
        clock = clock or get_clock()
        use_clock(clock)  # handlers read it through get_clock() in every task started from here
        async with anyio.create_task_group() as tg:
            rt = cls(store, registry, settings or Settings(), tg, clock, logs)
            tg.start_soon(rt.arms.run_timers)
            try:
                await rt.recover()
                tg.start_soon(rt.janitor.run)
                log_findings(registry)
                yield rt
            finally:
                rt.stopping = True
                tg.cancel_scope.cancel()

    # -- scheduling -------------------------------------------------------------------------

    def submit(self, workflow_id: str, item: Item) -> None:
        """Queue work for a workflow, starting its actor if it has none."""
        if self.hold.park(workflow_id, item):
            return
        actor = self.actors.get(workflow_id)
        if actor is None:
            actor = self.actors[workflow_id] = Actor(self, workflow_id)
            self._idle = anyio.Event()
            self.tg.start_soon(self._run_actor, actor)
        actor.items.append(item)
        actor.wake.set()

    async def _run_actor(self, actor: Actor) -> None:
        try:
            await actor.run()
        finally:
            del self.actors[actor.workflow_id]
            actor.done.set()
            if not self.actors:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no workflow has work in progress (used by tests and shutdown)."""
        while self.actors:
            await self._idle.wait()

    async def drain(self, grace_s: float) -> bool:
        """Stop taking work and wait up to `grace_s` for running steps; True if all finished."""
        self.stopping = True
        for actor in list(self.actors.values()):
            actor.stop_after_current()
        with anyio.move_on_after(grace_s):
            await self.wait_idle()
            return True
        return False

    async def _submit_callback(self, req: CallbackRequest, input: Any, wait: bool) -> Any:
        reply = Reply()
        item = Item("callback", req=req, input=input, reply=reply if wait else None)
        if self.stopping:
            if not wait:
                return None  # a timer due now is still armed in the store: it fires after restart
            raise Unavailable("workflowd is shutting down")
        self.submit(req.workflow_id, item)
        if wait:
            return await reply.wait()
        return None

    # -- loading ----------------------------------------------------------------------------

    async def load(self, workflow_id: str) -> Loaded:
        """Return the workflow from the cache, or load it from the store."""
        loaded = self.cache.get(workflow_id)
        if loaded is not None:
            self.cache.move_to_end(workflow_id)
            return loaded
        row = await self.store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        loaded = self.decode(row)
        self.remember(loaded)
        return loaded

    def decode(self, row: WorkflowRow) -> Loaded:
        """Turn a stored row into a live workflow; a corrupt row raises WorkflowError."""
        cls = self.registry.get(row.name)
        if cls is None:
            raise UnknownWorkflowType(f"workflow type {row.name!r} is not registered")
        try:
            wf = cls.from_json(row.data)
            state = State.from_json(row.state)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WorkflowError(f"corrupt row {row.id}: {e}") from e
        return Loaded(wf, state, attempt=row.attempt, error=row.error, next_run_at=row.next_run_at)

    def remember(self, loaded: Loaded) -> None:
        """Put a workflow in the bounded cache."""
        self.cache[loaded.state.id] = loaded
        self.cache.move_to_end(loaded.state.id)
        while len(self.cache) > self.settings.cache_size:
            oldest = next(iter(self.cache))
            if oldest in self.actors:
                break
            del self.cache[oldest]

    def forget(self, workflow_id: str) -> None:
        """Drop a workflow from the cache so the next load reads the store."""
        self.cache.pop(workflow_id, None)

    def rearm(self, loaded: Loaded) -> None:
        """Make the armed waits of a workflow match its state."""
        state = loaded.state
        wanted = {}
        armed = [
            (t.id, ev.req)
            for t in state.threads
            for ev in t.wait_events
            if ev.status is EventStatus.SETUP
        ]
        # Building the definition is the costly part; a workflow that just took a callback
        # usually has nothing set up, so skip it then.
        if armed and state.status not in FINAL_STATUSES:
            events = Definition(loaded.wf.definition()).events
            for thread_id, req in armed:
                on = events.get(req.name)
                if on is not None:
                    wanted[(state.id, thread_id, req.name, req.pc)] = (req, on.handler)
        self.arms.sync(state.id, wanted)

    async def recover(self) -> None:
        """Pick up every unfinished workflow: resume runnable ones, re-arm waiting ones."""
        counts = dict.fromkeys(("resumed", "armed", "broken", "held"), 0)
        async for row in self.store.unfinished():
            counts[await self.recover_one(row)] += 1
        for pending in await self.store.inbox_pending():
            req = CallbackRequest(pending.workflow_id, pending.thread_id, pending.event, pending.pc)
            self.submit(
                pending.workflow_id,
                Item("callback", req=req, input=pending.input, inbox_id=pending.id),
            )
        log.info("recovered", **counts)

    async def recover_one(self, row: WorkflowRow) -> str:
        """Resume or re-arm one unfinished workflow; return which (or "broken", "held")."""
        if self.hold.holds(row.id):
            return "held"
        try:
            loaded = self.decode(row)
        except WorkflowError as e:
            log.error("workflow_corrupt", workflow_id=row.id, workflow=row.name, error=str(e))
            await self.store.set_status(row.id, status=row.status, error=str(e))
            return "broken"
        state = loaded.state
        needs_setup = any(
            ev.status is not EventStatus.SETUP for t in state.threads for ev in t.wait_events
        )
        if state.status is WorkflowStatus.RESUMING or needs_setup:
            self.remember(loaded)
            self.submit(row.id, Item("resume"))
            return "resumed"
        try:
            self.rearm(loaded)
        except Exception as e:  # noqa: BLE001 - one bad definition must not stop recovery
            log.error("workflow_rearm_failed", workflow_id=row.id, error=str(e))
            return "broken"
        return "armed"

    # -- the API the control socket calls ---------------------------------------------------

    async def start(
        self, workflow: str, workflow_id: str | None = None, input: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Create a workflow and schedule it; starting an existing id returns it unchanged."""
        self._check_open()
        cls = self.registry.get(workflow)
        if cls is None:
            known = ", ".join(sorted(self.registry)) or "none"
            raise UnknownWorkflowType(f"no workflow type {workflow!r} (known: {known})")
        wid = workflow_id or uuid.uuid4().hex
        wf = cls.from_input(input)
        state = State.new(wid, workflow)
        now = time.time()
        row = WorkflowRow(
            wid,
            workflow,
            state.status,
            wf.to_json(),
            state.to_json(),
            created_at=now,
            updated_at=now,
        )
        if not await self.store.create(row, history=[("started", {"input": input or {}})]):
            existing = await self.store.get(wid)
            if existing is None:  # deleted in between; vanishingly rare
                raise Conflict(f"workflow {wid!r} changed while starting; try again")
            if existing.name != workflow:
                raise Conflict(
                    f"workflow {wid!r} exists and is a {existing.name}, not a {workflow}"
                )
            return {"workflow_id": wid, "status": existing.status, "created": False}
        log.info("workflow_started", workflow_id=wid, workflow=workflow)
        self.remember(Loaded(wf, state))
        self.submit(wid, Item("resume"))
        return {"workflow_id": wid, "status": state.status.value, "created": True}

    async def send(
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
        wait: bool = True,
    ) -> Any:
        """Deliver an event; returns the handler's output once it is durable."""
        self._check_open()
        loaded = await self.load(workflow_id)
        if loaded.state.status in FINAL_STATUSES:
            raise CallbackNotFound(f"workflow {workflow_id} is {loaded.state.status}")
        req = CallbackRequest(workflow_id, thread_id or "", event, pc or 0)
        if wait:
            if self.hold.holds(workflow_id):
                raise Unavailable(
                    f"workflow {workflow_id} is held: resume it, or send with no wait"
                )
            return await self._submit_callback(req, input, True)
        inbox_id = await self.store.inbox_put(
            workflow_id, event, input, thread_id=thread_id or "", pc=pc or 0
        )
        self.submit(workflow_id, Item("callback", req=req, input=input, inbox_id=inbox_id))
        return {"queued": True}

    async def cancel(self, workflow_id: str) -> dict[str, Any]:
        """Cancel a workflow: tear down its waits and stop a running step."""
        self._check_open()
        loaded = await self.load(workflow_id)
        if loaded.state.status in FINAL_STATUSES:
            return {"workflow_id": workflow_id, "status": loaded.state.status.value}
        reply = Reply()
        self.submit(workflow_id, Item("cancel", reply=reply))
        actor = self.actors.get(workflow_id)  # none while a repair holds the workflow off
        if actor is not None:
            actor.interrupt()
        await reply.wait()
        return {"workflow_id": workflow_id, "status": WorkflowStatus.CANCELLED.value}

    async def list(
        self, *, status: str | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Summarize workflows, newest first."""
        rows = await self.store.list(status=status, name=workflow, limit=limit)
        return [self._summary(row) for row in rows]

    async def show(self, workflow_id: str) -> dict[str, Any]:
        """Return a workflow's data, state and error."""
        row = await self.store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        out = self._summary(row)
        out.update(
            data=_json_or_text(row.data),
            state=_json_or_text(row.state),
            error=row.error,
            attempt=row.attempt,
            next_run_at=row.next_run_at,
            created_at=row.created_at,
        )
        actor = self.actors.get(workflow_id)
        if actor is not None and actor.running_step is not None:
            step, since = actor.running_step
            out["running_step"] = {"step": step, "for_s": round(time.monotonic() - since, 3)}
        if self.hold.holds(workflow_id):
            out["held"] = True
        return out

    async def history(
        self, workflow_id: str, *, limit: int = 1000
    ) -> builtins.list[dict[str, Any]]:
        """Return a workflow's history, oldest first."""
        if await self.store.get(workflow_id) is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        rows = await self.store.history(workflow_id, limit=limit)
        return [{"at": r.at, "kind": r.kind, **r.detail} for r in rows]

    async def counts(self) -> dict[str, int]:
        """Count workflows by status."""
        return await self.store.counts()

    def busy(self) -> int:
        """Count the workflows with a step, callback or resume in flight (not a retry backoff)."""
        return sum(1 for actor in self.actors.values() if actor.busy)

    def subscribe_logs(
        self, workflow_id: str | None = None, *, follow: bool = True
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Stream log records for `workflowctl logs`: the recent ones, then live ones if `follow`."""
        if self.logs is None:
            raise Unavailable("live logs are not enabled")
        if follow:
            return self.logs.subscribe(workflow_id)
        return _replay(self.logs.recent(workflow_id))

    async def gc(self, keep_days: float) -> int:
        """Delete finished, failed and cancelled workflows older than `keep_days`."""
        return await self.store.delete_finished(self.clock.now() - keep_days * 86400)

    # -- the operator's tools (daemon/repair.py) --------------------------------------------

    async def graph(self, workflow: str, workflow_id: str | None, format: str) -> str:
        """Draw a workflow type's definition; with an id, where that workflow is."""
        return await repair.graph(self, workflow, workflow_id, format)

    async def lint(self, workflow: str) -> builtins.list[dict[str, Any]]:
        """Check a workflow type's definition."""
        return repair.lint(self, workflow)

    async def goto(
        self, workflow_id: str, thread_id: str, statement: str, *, who: int | None = None
    ) -> dict[str, Any]:
        """Move a thread of a waiting or failed workflow to a statement and resume it."""
        return await repair.goto(self, workflow_id, thread_id, statement, who)

    async def edit(
        self, workflow_id: str, values: dict[str, Any], *, who: int | None = None
    ) -> dict[str, Any]:
        """Change data fields of a waiting or failed workflow."""
        return await repair.edit(self, workflow_id, values, who)

    async def undo(self, workflow_id: str, *, who: int | None = None) -> dict[str, Any]:
        """Revert the last goto or edit."""
        return await repair.undo(self, workflow_id, who)

    async def retry(self, workflow_id: str, *, who: int | None = None) -> dict[str, Any]:
        """Resume a failed workflow from its failing step."""
        return await repair.retry(self, workflow_id, who)

    async def release(self, workflow_id: str) -> dict[str, Any]:
        """Let one held workflow run."""
        return await repair.release(self, workflow_id)

    async def release_all(self) -> dict[str, Any]:
        """End the hold: every held workflow runs."""
        return await repair.release_all(self)

    async def collect_garbage(self, keep_days: float | None = None) -> dict[str, Any]:
        """Run the retention now."""
        return await repair.collect_garbage(self, keep_days)

    def _check_open(self) -> None:
        if self.stopping:
            raise Unavailable("workflowd is shutting down")

    def _summary(self, row: WorkflowRow) -> dict[str, Any]:
        waiting: builtins.list[str] = []
        try:
            state = State.from_json(row.state)
            waiting = [
                ev.req.name
                for t in state.threads
                for ev in t.wait_events
                if ev.status in (EventStatus.SETUP, EventStatus.PENDING_SETUP)
            ]
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        return {
            "workflow_id": row.id,
            "workflow": row.name,
            "status": row.status,
            "updated_at": row.updated_at,
            "waiting_for": waiting,
            "error": row.error,
        }


def _json_or_text(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
