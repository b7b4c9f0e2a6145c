"""The runtime: starts, resumes and recovers workflows, one actor per busy workflow."""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import structlog

from daemon.clock import Clock, get_clock, use_clock
from daemon.core.children import use_children
from daemon.core.definition import Definition
from daemon.core.handler import CallbackRequest
from daemon.core.lint import Finding, lint_workflow
from daemon.core.state import FINAL_STATUSES, EventStatus, State, WorkflowStatus
from daemon.core.workflow import Workflow, timeout_of
from daemon.errors import BadRequest, CallbackNotFound, Conflict, Unavailable, WorkflowNotFound
from daemon.observe.metrics import Metrics
from daemon.runtime.actor import Actor
from daemon.runtime.arming import NODE_LOCAL, Arms
from daemon.runtime.cache import Cache, Loaded, Registry
from daemon.runtime.children import ChildLinks, composition
from daemon.runtime.deadlines import Deadlines
from daemon.runtime.endings import Endings, describe_types
from daemon.runtime.janitor import Janitor
from daemon.runtime.leases import Leases
from daemon.runtime.recovery import Recovery
from daemon.runtime.scheduler import Hold, Scheduler
from daemon.runtime.settings import Settings
from daemon.runtime.work import Item, Reply
from daemon.store.base import (
    EarlyFires,
    History,
    Position,
    Shared,
    Sleepers,
    Store,
    WorkflowRow,
)

#: Workflows summarized between two checkpoints of `page` (~2 ms of the event loop).
SUMMARY_SLICE = 100
#: Workflows a batch start (a schedule's fires) wrote that run at once at most; the rest wait
#: their turn, durable, so that the loop's ready queue stays short and the next fires are on
#: time however many runs are behind. (10,000 schedules every second: 128 kept the fires on
#: time but left the runs waiting on the writer's round trips, ~200 runs/s; 1,024 keeps both
#: going, measured.)
ADMIT_MAX = 1024
#: The same while a large instant's fires are built and written ahead of it (`hold_turns`):
#: they have the loop and the writer first, the runs still go on (none starves).
ADMIT_HELD = 128
#: Workflows waiting their turn kept in memory as written at most (a backlog past it costs a
#: read each when its turn comes, not memory).
FRESH_MAX = 100_000

log = structlog.get_logger()
#: Writes a new workflow's row (and whatever must commit with it); False if the id exists.
Create = Callable[[WorkflowRow, History], Awaitable[bool]]
#: Writes many new workflows' rows at once; True for each inserted (False: the id exists).
CreateMany = Callable[[Sequence[tuple[WorkflowRow, History]]], Awaitable[builtins.list[bool]]]


@dataclasses.dataclass(slots=True)
class Prepared:
    """A workflow built by `Runtime.prepare_many`, not yet written: `launch_many` starts it."""

    row: WorkflowRow
    history: History
    #: Its deadline's seconds, counted again from the write (None: no deadline).
    timeout: float | None
    #: Makes the workflow in memory, as its row holds it, from its id: when it first runs.
    make: Callable[[str], Loaded]


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
    """Runs every workflow of one store; the control socket calls its public methods.

    Its parts (`cache`, `scheduler`, `arms`, `recovery`, `janitor`) are public for the
    composition root, which hands them to the operator's tools; no part is given the runtime.
    """

    def __init__(
        self,
        store: Store,
        registry: Registry,
        settings: Settings,
        tg: anyio.abc.TaskGroup,
        clock: Clock,
        logs: LogSource | None = None,
        metrics: Metrics | None = None,
        shared: Shared | None = None,
        lease_s: float = 15.0,
    ) -> None:
        self.store, self.settings, self.clock, self.logs = store, settings, clock, logs
        #: The store's side shared with other daemons (PostgreSQL), or None (SQLite: one daemon).
        self.shared = shared
        self.metrics = metrics
        #: Called when a workflow has ended durably; `main` wakes the hooks.
        self.on_ended: Callable[[], None] | None = None
        self.limiter = anyio.CapacityLimiter(settings.max_concurrent_steps)
        self.cache = Cache(store, registry, settings.cache_size, pinned=self._running)
        self.scheduler = Scheduler(
            cache=self.cache, hold=Hold(settings.hold), new_actor=self._new_actor
        )
        self.arms = Arms(
            tg, clock, self._submit_callback, self._listen_failed, metrics, fire=self._fire_timer
        )
        self.deadlines = Deadlines(tg, clock, self._expire)
        self.children = ChildLinks(
            store=store,
            start=self._start_child,
            cancel=self.cancel,
            type_of=lambda name: self.cache.registry.get(name),
        )
        self.recovery = Recovery(
            store=store,
            cache=self.cache,
            scheduler=self.scheduler,
            arms=self.arms,
            deadline=self.deadlines.add,
            sleepers=store if isinstance(store, Sleepers) else None,
            deferred=store if isinstance(store, EarlyFires) else None,
        )
        self.cache.vet = self.recovery.vet
        self.endings = Endings(
            store=store,
            running=self._running,
            workflow_type=lambda name: self.cache.registry.get(name),
            # Shared, a Resuming workflow with no actor here is running (or about to be claimed)
            # somewhere: it is blocked once its status says so.
            elsewhere=(lambda row: False)
            if shared is None
            else lambda row: (
                row.status == WorkflowStatus.RESUMING.value
                and not self.scheduler.hold.holds(row.id)
            ),
        )
        #: Told each workflow whose actor exited, with its status then (schedules wait on it).
        self.on_exit: Callable[[str, str | None], None] | None = None
        #: Workflows `launch_many` wrote, waiting for their turn to run, oldest first.
        self._admitting: deque[str] = deque()
        #: Workflows `launch_many` wrote ahead of their time, until `release` or `withdraw`.
        self._early: dict[str, Prepared] = {}
        #: While above 0 at most ADMIT_HELD run at once (`hold_turns`): a large instant is
        #: being built and written.
        self._turns_held = 0
        #: Of those, the ones let run whose actor has not exited yet (at most ADMIT_MAX).
        self._admitted: set[str] = set()
        #: `launch_many` writes in flight (work in progress too), and an event set when none is.
        self._launching = 0
        self._launched = asyncio.Event()
        self._launched.set()
        self.scheduler.on_exit = self._exited
        hold = self.scheduler.hold
        # Shared, the janitor is one of the singleton duties: the leader's.
        leads = shared.leads if shared is not None else lambda: True
        self.janitor = Janitor(
            store=store,
            cache=self.cache,
            skip=lambda wid: self.scheduler.running(wid) or hold.holds(wid) or not leads(),
        )
        self.leases = (
            None
            if shared is None
            else Leases(
                shared=shared,
                lease_s=lease_s,
                recover=self._claimed,
                submit=self.scheduler.submit,
                lose=self._lost,
                ended=self._ended_somewhere,
                waited=self.endings.waited,
                stopping=lambda: self.scheduler.stopping,
                pinned=self.arms.pinned,
            )
        )

    async def _claimed(self, row: WorkflowRow, moved: bool = False) -> str:
        """Take up a workflow this daemon just claimed: resume or re-arm it, from its row.

        `moved`: its node-local waits were set up on a node gone for `pin_timeout_s`; they are
        set up again here (the resume runs their setup).
        """
        self.cache.forget(row.id)  # a copy from an earlier lease of it may be stale
        if moved:
            row = self._set_up_again(row)
        return await self.recovery.recover_one(row)

    def _set_up_again(self, row: WorkflowRow) -> WorkflowRow:
        """Return `row` with its FileWatch and SocketListen waits due for setup again."""
        try:
            loaded = self.cache.decode(row)
            events = Definition(loaded.wf.definition()).events
        except Exception:  # noqa: BLE001 - recovery holds it and says why
            return row
        for t in loaded.state.threads:
            for ev in t.wait_events:
                on = events.get(ev.req.name)
                kind = getattr(on.handler, "type", "") if on is not None else ""
                if ev.status is EventStatus.SETUP and kind in NODE_LOCAL:
                    ev.status = EventStatus.PENDING_SETUP
        return dataclasses.replace(row, state=loaded.state.to_json())

    def _lost(self, workflow_id: str) -> None:
        """Drop a workflow whose lease another daemon took: stop its actor, disarm its waits."""
        log.warning("lease_lost", workflow_id=workflow_id)
        actor = self.scheduler.actor(workflow_id)
        if actor is not None:
            actor.lose()
        self.arms.disarm_workflow(workflow_id)
        self.cache.forget(workflow_id)

    def _ended_somewhere(self, workflow_id: str) -> None:
        """Wake what waits for endings: a workflow ended or waits (on this daemon or another)."""
        self.endings.exited(workflow_id)
        self.children.ended(workflow_id)  # a parent here re-reads its child's row
        if self.on_ended is not None:
            self.on_ended()

    def _remote(self, workflow_id: str) -> Leases | None:
        """Return the way to another daemon if it (or nobody yet) runs the workflow."""
        if self.leases is None or self.shared is None or self.shared.owns(workflow_id):
            return None
        return self.leases

    def _running(self, workflow_id: str) -> bool:
        return self.scheduler.running(workflow_id)

    def _exited(self, workflow_id: str, status: str | None) -> None:
        if workflow_id in self._admitted:
            self._admitted.discard(workflow_id)
            if self._admitting:
                self._admit()
        self.endings.exited(workflow_id)
        if self.on_exit is not None:
            self.on_exit(workflow_id, status)

    def _new_actor(self, workflow_id: str) -> Actor:
        return Actor(
            workflow_id=workflow_id,
            store=self.store,
            cache=self.cache,
            arms=self.arms,
            clock=self.clock,
            settings=self.settings,
            limiter=self.limiter,
            on_leftover=self.janitor.wake,
            metrics=self.metrics,
            on_ended=self._ended,
        )

    def _ended(self, workflow_id: str) -> None:
        self.children.ended(workflow_id)
        if self.on_ended is not None:
            self.on_ended()

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        store: Store,
        registry: Registry,
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
        logs: LogSource | None = None,
        metrics: Metrics | None = None,
        shared: Shared | None = None,
        lease_s: float = 15.0,
    ) -> AsyncIterator[Runtime]:
        """Run a runtime (recovering every unfinished workflow) until the block exits.

        On a `shared` store it recovers only what it claims (daemon.runtime.leases), a batch
        at a time, and goes on claiming while it runs.
        """
        clock = clock or get_clock()
        use_clock(clock)  # handlers read it through get_clock() in every task started from here
        async with anyio.create_task_group() as tg:
            rt = cls(
                store, registry, settings or Settings(), tg, clock, logs, metrics, shared, lease_s
            )
            use_children(rt.children)  # Child handlers find it as they find the clock
            tg.start_soon(rt.scheduler.run)
            tg.start_soon(rt.arms.run_timers)
            tg.start_soon(rt.deadlines.run)
            try:
                if rt.leases is not None:
                    await tg.start(rt.leases.run)
                else:
                    await rt.recover()
                    tg.start_soon(rt.recovery.check_rest)
                tg.start_soon(rt.janitor.run)
                log_findings(registry)
                yield rt
            finally:
                rt.scheduler.stopping = True
                tg.cancel_scope.cancel()

    def configure(self, registry: Registry, settings: Settings) -> None:
        """Use new workflow classes and tunables from now on (a reload); checks the new code."""
        self.cache.registry = registry
        self.settings = dataclasses.replace(settings, cache_size=self.settings.cache_size)
        self.limiter.total_tokens = settings.max_concurrent_steps
        log_findings(registry)

    # -- scheduling -------------------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Return once no workflow has work in progress (used by tests and shutdown)."""
        while True:
            await self.scheduler.wait_idle()
            if self._launching:  # a batch being written runs once it is
                await self._launched.wait()
            elif self._admitting and not self.scheduler.stopping:  # turns come as actors exit
                self._admit()
                await anyio.lowlevel.checkpoint()
            else:
                return

    async def drain(self, grace_s: float) -> bool:
        """Stop taking work and wait up to `grace_s` for running steps; True if all finished."""
        self.endings.stop()  # a `wait` gets `unavailable` now, not a hang-up later
        return await self.scheduler.drain(grace_s)

    async def _submit_callback(self, req: CallbackRequest, input: Any, wait: bool) -> Any:
        reply = Reply() if wait else None  # a fired timer waits for nothing: no event made
        item = Item("callback", req=req, input=input, reply=reply)
        if self.scheduler.stopping:
            if not wait:
                return None  # a timer due now is still armed in the store: it fires after restart
            raise Unavailable("workflowd is shutting down")
        self.scheduler.submit(req.workflow_id, item)
        if reply is not None:
            return await reply.wait()
        return None

    def _fire_timer(self, req: CallbackRequest, input: Any) -> None:
        """Queue a fired timer's callback; nobody waits for its answer."""
        # Shutting down, it is dropped: still armed in the store, it fires after the restart.
        if not self.scheduler.stopping:
            self.scheduler.submit(req.workflow_id, Item("callback", req=req, input=input))

    def _listen_failed(self, req: CallbackRequest, error: str) -> None:
        """Have the workflow's actor record an armed wait whose listener failed as SetupError."""
        if not self.scheduler.stopping:
            self.scheduler.submit(req.workflow_id, Item("listen_failed", req=req, input=error))

    # -- recovery ---------------------------------------------------------------------------

    async def recover(self) -> None:
        """Pick up every unfinished workflow: resume, re-arm, or hold it if it does not fit."""
        await self.recovery.recover()

    async def recover_one(self, row: WorkflowRow) -> str:
        """Resume, re-arm or hold one unfinished workflow; return which (see `Recovery`)."""
        return await self.recovery.recover_one(row)

    async def refit(self) -> builtins.list[dict[str, Any]]:
        """Release the held workflows that fit the code now registered; return the others."""
        return await self.recovery.refit()

    def unfit(self, workflow_id: str) -> str | None:
        """Say why a workflow is held for not fitting the running code, or None."""
        return self.scheduler.hold.incompatible.get(workflow_id)

    def incompatible(self) -> int:
        """Count the workflows held because they do not fit the running code."""
        return len(self.scheduler.hold.incompatible)

    # -- the API the control socket calls ---------------------------------------------------

    async def start(
        self,
        workflow: str,
        workflow_id: str | None = None,
        input: dict[str, Any] | None = None,
        *,
        create: Create | None = None,
        parent: str | None = None,
        timeout_s: float | None = None,
        quiet: bool = False,
    ) -> dict[str, Any]:
        """Create a workflow and schedule it; starting an existing id returns it unchanged.

        `create` writes the new row instead of `store.create` (a schedule commits its own
        bookkeeping in the same transaction); it returns False if the id exists. `parent` is
        the workflow whose Child case starts it; `timeout_s` overrides the class's deadline.
        `quiet` leaves out the `workflow_started` line: the caller logs the start its way.
        """
        self._check_open()
        loaded, row, history = self._new_row(workflow, workflow_id, input, parent, timeout_s)
        if not await (create or self.store.create)(row, history):
            return await self._existing(row.id, workflow)
        return self._launch(loaded, row, quiet=quiet)

    async def start_many(
        self, starts: Sequence[tuple[str, str, dict[str, Any] | None]], *, create: CreateMany
    ) -> builtins.list[dict[str, Any] | Exception]:
        """Start many workflows (type, id, input) with one write; one answer or error each.

        A start that cannot be made (an unknown type, bad input) gets its error and stays out
        of the write; the others go on. `create` writes the new rows at once, as `start`'s
        `create` does one, and says which were inserted; if it raises, so does this.
        """
        made = self.prepare_many(starts)
        ready = [m for m in made if isinstance(m, Prepared)]
        out = iter(await self.launch_many(ready, create=create))
        return [m if isinstance(m, Exception) else next(out) for m in made]

    def prepare_many(
        self, starts: Sequence[tuple[str, str, dict[str, Any] | None]]
    ) -> builtins.list[Prepared | Exception]:
        """Build many workflows (type, id, input) ahead of their start; nothing is written.

        A start that cannot be made (an unknown type, bad input) gets its error instead. The
        rows are stamped again when `launch_many` writes them: built early, they are not old.
        """
        self._check_open()
        out: builtins.list[Prepared | Exception] = []
        #: (type, input as JSON) -> a workflow built from them: schedules share their input.
        #: Made in this call, from the classes registered now (nothing can reload meanwhile).
        built: dict[tuple[str, bytes | None], _Twin] = {}
        now = self.clock.now()
        for workflow, wid, input in starts:
            key = (workflow, _input_key(input))
            twin = built.get(key) if key[1] is not None else None
            if twin is not None:
                out.append(twin.make(wid, input, now))
                continue
            try:
                loaded, row, history = self._new_row(workflow, wid, input, None, None)
            except Exception as e:  # noqa: BLE001 - answered to its caller, the others go on
                out.append(e)
                continue
            timeout = None if row.deadline is None else timeout_of(type(loaded.wf))
            if key[1] is not None and _copyable(loaded.wf):
                # A copy of its own: the first start's object runs (and changes) before the
                # copies of the others are made, at their turns.
                made = _Twin.of(_copy(loaded.wf), row, timeout)
                if made is not None:
                    built[key] = made
            out.append(Prepared(row, history, timeout, _kept(loaded)))
        return out

    async def launch_many(
        self,
        prepared: Sequence[Prepared],
        *,
        create: CreateMany,
        not_before: float | None = None,
    ) -> builtins.list[dict[str, Any] | Exception]:
        """Write workflows built by `prepare_many` with one `create`, then run them.

        Their rows are stamped with the time of this write (and their deadlines counted from
        it). The caller logs each start (a schedule's `schedule_fired` names the workflow), so
        no `workflow_started` line is added. One answer or error each; if `create` raises, so
        does this. With `not_before` (a batch written ahead of its time) they are stamped with
        that time and kept until `release` (or `withdraw`) instead of run.
        """
        self._check_open()
        if not prepared:
            return []
        now, clock_now = time.time(), self.clock.now()
        if not_before is not None:
            now, clock_now = max(now, not_before), max(clock_now, not_before)
        for p in prepared:
            row = p.row
            row.created_at = row.updated_at = now
            if p.timeout is not None:
                row.deadline = clock_now + p.timeout
                p.history[0][1]["deadline"] = row.deadline
        self._launching += 1
        self._launched.clear()
        try:
            created = await create([(p.row, p.history) for p in prepared])
        finally:
            self._launching -= 1
            if not self._launching:
                self._launched.set()
        out: builtins.list[dict[str, Any] | Exception] = []
        held = self._early if not_before is not None else None
        for p, inserted in zip(prepared, created, strict=True):
            try:
                if inserted and held is not None:
                    held[p.row.id] = p
                    # Kept in memory from the write on: a cancel (or any load) before the
                    # release takes it from here, so the release never runs a stale copy.
                    if len(self.cache.fresh) < FRESH_MAX:
                        self.cache.fresh[p.row.id] = p.make
                    out.append({"workflow_id": p.row.id, "status": p.row.status, "created": True})
                    continue
                out.append(
                    self._admitted_later(p)
                    if inserted
                    else await self._existing(p.row.id, p.row.name)
                )
            except Exception as e:  # noqa: BLE001 - answered to its caller, the others go on
                out.append(e)
        self._admit()
        return out

    def release(self, workflow_ids: Sequence[str]) -> None:
        """Let workflows `launch_many` wrote ahead of their time run (at that time), in turns."""
        early = self._early
        for wid in workflow_ids:
            p = early.pop(wid, None)
            if p is not None:
                self._admitted_later(p, fresh=False)  # in `cache.fresh` since the write
        self._admit()

    def hold_turns(self, held: bool) -> None:
        """Let at most ADMIT_HELD run at once while held (a large instant's fires are built
        and written ahead of it). Calls nest; the last release gives the turns back.
        """
        self._turns_held += 1 if held else -1
        if not self._turns_held:
            self._admit()

    def withdraw(self, workflow_ids: Sequence[str]) -> None:
        """Forget workflows written ahead of their time whose write was taken back."""
        for wid in workflow_ids:
            if self._early.pop(wid, None) is not None:
                self.cache.fresh.pop(wid, None)

    def _admitted_later(self, p: Prepared, *, fresh: bool = True) -> dict[str, Any]:
        """Run a workflow `launch_many` just wrote when its turn comes (`_admit`).

        `fresh`: keep its maker in `cache.fresh` (False: put there at the write already).
        """
        row = p.row
        wid = row.id
        if self.leases is not None:  # whichever daemon is free claims it (woken by a NOTIFY)
            return {"workflow_id": wid, "status": row.status, "created": True}
        if row.deadline is not None:
            self.deadlines.add(wid, row.deadline)
        if fresh and len(self.cache.fresh) < FRESH_MAX:  # past it, its run reads its row
            self.cache.fresh[wid] = p.make
        self._admitting.append(wid)
        return {"workflow_id": wid, "status": row.status, "created": True}

    def _admit(self) -> None:
        """Let the workflows waiting their turn run, up to ADMIT_MAX at once.

        Each is durable (Resuming) from its write on: one not let run before a crash or a
        shutdown is resumed by the next start's recovery.
        """
        limit = ADMIT_HELD if self._turns_held else ADMIT_MAX
        waiting, admitted, scheduler = self._admitting, self._admitted, self.scheduler
        while waiting and len(admitted) < limit and not scheduler.stopping:
            wid = waiting.popleft()
            scheduler.submit(wid, Item("resume"))
            if scheduler.running(wid):  # not parked by a hold: its exit frees the turn
                admitted.add(wid)

    def _new_row(
        self,
        workflow: str,
        workflow_id: str | None,
        input: dict[str, Any] | None,
        parent: str | None,
        timeout_s: float | None,
    ) -> tuple[Loaded, WorkflowRow, History]:
        """Make a new workflow's row and its first history entry, not yet written."""
        cls = self.cache.workflow_type(workflow)
        wid = workflow_id or uuid.uuid4().hex
        wf = cls.from_input(input)
        state = State.new(wid, workflow)
        now = time.time()
        if timeout_s is not None and not (0 < timeout_s < float("inf")):
            raise BadRequest(f"timeout_s must be seconds > 0, not {timeout_s!r}")
        timeout = timeout_s if timeout_s is not None else timeout_of(cls)
        deadline = None if timeout is None else self.clock.now() + timeout
        row = WorkflowRow(
            wid,
            workflow,
            state.status,
            wf.to_json(),
            state.to_json(),
            created_at=now,
            updated_at=now,
            parent=parent,
            deadline=deadline,
        )
        started: dict[str, Any] = {"input": input or {}}
        if parent is not None:
            started["parent"] = parent
        if deadline is not None:
            started["deadline"] = deadline
        return Loaded(wf, state), row, [("started", started)]

    async def _existing(self, wid: str, workflow: str) -> dict[str, Any]:
        """Answer a start whose id exists: unchanged if of the same type, else a conflict."""
        existing = await self.store.get(wid)
        if existing is None:  # deleted in between; vanishingly rare
            raise Conflict(f"workflow {wid!r} changed while starting; try again")
        if existing.name != workflow:
            raise Conflict(
                f"workflow {wid!r} exists and is {_a(existing.name)}, not {_a(workflow)}"
            )
        return {"workflow_id": wid, "status": existing.status, "created": False}

    def _launch(self, loaded: Loaded, row: WorkflowRow, *, quiet: bool = False) -> dict[str, Any]:
        """Run a workflow whose row was just written; `quiet` when the caller logs the start."""
        wid = row.id
        if not quiet:
            log.info("workflow_started", workflow_id=wid, workflow=row.name, parent=row.parent)
        if self.leases is not None:  # whichever daemon is free claims it (woken by a NOTIFY)
            return {"workflow_id": wid, "status": loaded.state.status.value, "created": True}
        if row.deadline is not None:
            self.deadlines.add(wid, row.deadline)
        self.cache.remember(loaded)
        self.scheduler.submit(wid, Item("resume"))
        return {"workflow_id": wid, "status": loaded.state.status.value, "created": True}

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
        if wait:
            reply = self.send_now(workflow_id, event, input, thread_id=thread_id, pc=pc)
            if reply is not None:
                return await reply.wait()
        self._check_open()
        remote = self._remote(workflow_id)
        if remote is not None:
            await self._row_open(workflow_id)
            return await remote.send(
                workflow_id, event, input, thread_id=thread_id or "", pc=pc or 0, wait=wait
            )
        unfit = self.scheduler.hold.incompatible.get(workflow_id)
        if unfit is not None:
            raise Conflict(f"workflow {workflow_id} does not fit the running code: {unfit}")
        self._check_started(workflow_id)
        loaded = await self.cache.load(workflow_id)
        if loaded.state.status in FINAL_STATUSES:
            raise CallbackNotFound(f"workflow {workflow_id} is {loaded.state.status}")
        req = CallbackRequest(workflow_id, thread_id or "", event, pc or 0)
        if wait:
            if self.scheduler.hold.holds(workflow_id):
                raise Unavailable(
                    f"workflow {workflow_id} is held: resume it, or send with no wait"
                )
            return await self._submit_callback(req, input, True)
        inbox_id = await self.store.inbox_put(
            workflow_id, event, input, thread_id=thread_id or "", pc=pc or 0
        )
        self.scheduler.submit(
            workflow_id, Item("callback", req=req, input=input, inbox_id=inbox_id)
        )
        return {"queued": True}

    def send_now(
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
    ) -> Reply | None:
        """Queue an event whose sender waits, if that needs no I/O; return the sender's reply.

        None: the workflow is not in memory (or another daemon runs it), and `send` must read
        it first. Errors are raised as `send` raises them; the reply holds the handler's output
        once it is durable, or the error that kept it from being applied.
        """
        scheduler = self.scheduler
        if scheduler.stopping:
            self._check_open()  # raises: no call to find that out on the common path
        if self.leases is not None and self._remote(workflow_id) is not None:
            return None  # without leases (SQLite) nothing is remote: no look needed
        hold = scheduler.hold
        unfit = hold.incompatible.get(workflow_id)
        if unfit is not None:
            raise Conflict(f"workflow {workflow_id} does not fit the running code: {unfit}")
        if workflow_id in self._early or workflow_id in self.recovery.deferred:
            self._check_started(workflow_id)  # raises
        loaded = self.cache.touch(workflow_id)
        if loaded is None:
            return None
        if loaded.state.status in FINAL_STATUSES:
            raise CallbackNotFound(f"workflow {workflow_id} is {loaded.state.status}")
        # Not unfit (looked at above), so only `--hold` can hold it: one look when nothing is.
        if hold.held and hold.holds(workflow_id):
            raise Unavailable(f"workflow {workflow_id} is held: resume it, or send with no wait")
        reply = Reply()
        req = CallbackRequest(workflow_id, thread_id or "", event, pc or 0)
        self.scheduler.submit(workflow_id, Item("callback", req=req, input=input, reply=reply))
        return reply

    def _check_started(self, workflow_id: str) -> None:
        """Raise WorkflowNotFound for a workflow written ahead of its time, before that time.

        A schedule's large instant is committed early (see `launch_many`); until the instant
        its workflows do not exist for an event, as if they had not been written yet: an
        event applied before then would run the workflow before its time.
        """
        if workflow_id in self._early or workflow_id in self.recovery.deferred:
            raise WorkflowNotFound(f"no workflow {workflow_id!r} yet: its schedule starts it later")

    async def _row_open(self, workflow_id: str) -> None:
        """Raise unless the stored workflow exists and has not ended (a request for it may wait)."""
        row = await self.store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        if row.status in FINAL_STATUSES:
            raise CallbackNotFound(f"workflow {workflow_id} is {row.status}")

    async def _start_child(
        self, workflow: str, workflow_id: str, input: dict[str, Any] | None, parent: str
    ) -> None:
        await self.start(workflow, workflow_id, input, parent=parent)

    async def _expire(self, workflow_id: str, error: str) -> None:
        """Cancel a workflow whose deadline passed (with that error), if it still runs."""
        row = await self.store.get(workflow_id)
        if row is None or row.status in FINAL_STATUSES:
            return
        await self.cancel(workflow_id, error=error)
        log.info("deadline_passed", workflow_id=workflow_id, workflow=row.name)

    async def cancel(
        self, workflow_id: str, *, by: str | None = None, error: str | None = None
    ) -> dict[str, Any]:
        """Cancel a workflow: tear down its waits and stop a running step.

        Its children are cancelled too, per their policy. `by` names who asked ("dashboard"),
        for the history record; `error` says why (a deadline that passed).
        """
        self._check_open()
        remote = self._remote(workflow_id)
        if remote is not None:
            row = await self.store.get(workflow_id)
            if row is None:
                raise WorkflowNotFound(f"no workflow {workflow_id!r}")
            if row.status in FINAL_STATUSES:
                return _cancelled_again(workflow_id, row.status)
            done = await remote.cancel(workflow_id, {"by": by, "error": error})
            status = done.get("status") if isinstance(done, dict) else None
            # It may have ended otherwise meanwhile, on its owner: said as for a local one.
            return _cancelled_again(workflow_id, str(status or WorkflowStatus.CANCELLED.value))
        try:
            loaded = await self.cache.load(workflow_id)
        except Conflict as e:  # its row does not decode: no actor can load it
            return await self._cancel_undecodable(workflow_id, str(e))
        if loaded.state.status in FINAL_STATUSES:
            return _cancelled_again(workflow_id, loaded.state.status.value)
        reply = Reply()
        # Queueing it interrupts the workflow's actor.
        cancel = Item("cancel", input={"by": by, "error": error}, reply=reply)
        self.scheduler.submit(workflow_id, cancel)
        await reply.wait()
        if self.scheduler.hold.incompatible.pop(workflow_id, None) is not None:
            await self._drop_parked(workflow_id)
        return {"workflow_id": workflow_id, "status": WorkflowStatus.CANCELLED.value}

    async def _cancel_undecodable(self, workflow_id: str, problem: str) -> dict[str, Any]:
        """Cancel a workflow whose row does not decode, without its waits' teardown."""
        row = await self.store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        if row.status in FINAL_STATUSES:
            return _cancelled_again(workflow_id, row.status)
        note = f"cancelled without tearing down its waits: {problem}"
        await self.store.set_status(
            workflow_id,
            status=WorkflowStatus.CANCELLED.value,
            error=row.error,
            history=[("cancelled", {"error": None, "note": note})],
        )
        log.warning("workflow_cancelled", workflow_id=workflow_id, workflow=row.name, note=note)
        self.scheduler.hold.incompatible.pop(workflow_id, None)
        self.cache.forget(workflow_id)
        self.endings.exited(workflow_id)
        await self._drop_parked(workflow_id)
        self.children.ended(workflow_id)
        return {"workflow_id": workflow_id, "status": WorkflowStatus.CANCELLED.value}

    async def _drop_parked(self, workflow_id: str) -> None:
        """Reject what was queued for a held workflow that was cancelled, inbox rows included."""
        ended = CallbackNotFound(f"workflow {workflow_id} is Cancelled")
        inbox = []
        for item in self.scheduler.hold.parked.pop(workflow_id, []):
            if item.reply is not None:
                item.reply.fail(ended)
            if item.inbox_id is not None:
                inbox.append(item.inbox_id)
        if inbox:
            log.info("inbox_dropped", workflow_id=workflow_id, count=len(inbox), reason="cancelled")
            await self.store.inbox_done(inbox)

    async def list(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        parent: str | None = None,
    ) -> list[dict[str, Any]]:
        """Summarize workflows, newest first; `parent` keeps the children of one workflow."""
        rows, _ = await self.page(status=status, workflow=workflow, limit=limit, parent=parent)
        return rows

    async def page(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        after: Position | None = None,
        parent: str | None = None,
    ) -> tuple[builtins.list[dict[str, Any]], Position | None]:
        """Summarize up to `limit` workflows after `after`, newest first; return where to go on.

        Each summary decodes the workflow's state, so they are made a slice at a time with a
        checkpoint between: a page of 1000 never holds the event loop for more than a slice.
        """
        rows, position = await self.store.page(
            status=status, name=workflow, limit=limit, after=after, parent=parent
        )
        out: builtins.list[dict[str, Any]] = []
        for start in range(0, len(rows), SUMMARY_SLICE):
            if start:
                await anyio.lowlevel.checkpoint()
            out += [self._summary(row) for row in rows[start : start + SUMMARY_SLICE]]
        return out, position

    async def show(self, workflow_id: str) -> dict[str, Any]:
        """Return a workflow's data, state and error."""
        row = await self.store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        # Every read first: a show waiting for the store holds no decoded copy of the data
        # (a flood of shows of a big workflow would hold one each).
        related = await composition(self.store, row)
        retry = await self._retry_of(row) if row.attempt and row.next_run_at is not None else None
        out = self._summary(row)
        out.update(
            data=_json_or_text(row.data),
            state=_json_or_text(row.state),
            error=row.error,
            attempt=row.attempt,
            next_run_at=row.next_run_at,
            created_at=row.created_at,
        )
        out.update(related)
        running = actor.running if (actor := self.scheduler.actor(workflow_id)) else []
        if running:
            out["running_step"] = running[0][1].shown()
        out["running"] = [
            {"thread_id": thread_id, "step": run.step, "since": run.since}
            for thread_id, run in running
        ]
        if self.scheduler.hold.holds(workflow_id):
            out["held"] = True
        if retry is not None:
            out["retry"] = retry
        if self.shared is not None:
            out["owner"] = await self.shared.owner_of(workflow_id)
        return out

    async def _retry_of(self, row: WorkflowRow) -> dict[str, Any]:
        """Say which step is retried and how many attempts it may make (0: no limit)."""
        failed = [r for r in await self.store.history(row.id, limit=20) if r.kind == "step_failed"]
        step = failed[-1].detail.get("step") if failed else None
        limit = self.settings.retry_max_attempts
        cls = self.cache.registry.get(row.name)
        if isinstance(step, str) and cls is not None:
            try:
                found = Definition(cls.from_json(row.data).definition()).steps.get(step)
            except Exception:  # noqa: BLE001 - workflow code: the limit is then the default
                found = None
            retry = found.retry if found is not None else None
            if retry is not None and retry.max_attempts is not None:
                limit = retry.max_attempts
        return {"step": step, "attempt": row.attempt, "max_attempts": limit}

    async def history(
        self, workflow_id: str, *, limit: int = 1000
    ) -> builtins.list[dict[str, Any]]:
        """Return a workflow's history, oldest first."""
        if await self.store.get(workflow_id) is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        rows = await self.store.history(workflow_id, limit=limit)
        return [{"at": r.at, "kind": r.kind, **r.detail} for r in rows]

    async def wait(
        self,
        workflow_ids: builtins.list[str],
        *,
        any: bool = False,
        timeout_s: float | None = None,
        until: str = "ended",
    ) -> dict[str, Any]:
        """Answer once the workflows end (all, or one with `any`), or after `timeout_s`."""
        self._check_open()
        return await self.endings.wait(workflow_ids, any=any, timeout_s=timeout_s, until=until)

    def types(self) -> builtins.list[dict[str, Any]]:
        """Describe the registered workflow types and their input fields."""
        return describe_types(self.cache.registry)

    async def status_of(self, workflow_id: str) -> str | None:
        """Return a workflow's status (from memory when loaded), or None if there is none."""
        loaded = self.cache.get(workflow_id)
        if loaded is not None:
            return loaded.state.status.value
        row = await self.store.get(workflow_id)
        return row.status if row is not None else None

    async def counts(self) -> dict[str, int]:
        """Count workflows by status."""
        return await self.store.counts()

    def busy(self) -> int:
        """Count the workflows with a step, callback or resume in flight (not a retry backoff).

        Started workflows being written or waiting for their turn to run count too.
        """
        return self.scheduler.busy() + len(self._admitting) + len(self._early) + self._launching

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

    def _check_open(self) -> None:
        if self.scheduler.stopping:
            raise Unavailable("workflowd is shutting down")

    def _summary(self, row: WorkflowRow) -> dict[str, Any]:
        actor = self.scheduler.actor(row.id)
        return summary(
            row,
            incompatible=self.scheduler.hold.incompatible.get(row.id),
            running=[run.step for _, run in actor.running] if actor else [],
        )


def summary(
    row: WorkflowRow, *, incompatible: str | None = None, running: builtins.list[str] | None = None
) -> dict[str, Any]:
    """Summarize a stored workflow as `list` shows it (the runtime adds what it alone knows)."""
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
        "incompatible": incompatible,
        "parent": row.parent,
        "running": running or [],
    }


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _input_key(input: dict[str, Any] | None) -> bytes | None:
    """Return a start's input as JSON (equal inputs, equal keys), or None if it is not JSON."""
    if not input:
        return b""
    try:
        return msgspec.json.encode(input)
    except (TypeError, msgspec.EncodeError):
        return None


def _copyable(wf: Workflow) -> bool:
    """Tell whether a copy of `wf` is what building another from its input would give.

    It is when its fields all hold scalars, in its `__dict__` (a copy may share them), and
    nothing makes a value per instance: no `default_factory` (a uuid, a time), no
    `__post_init__`.
    """
    cls = type(wf)
    attrs = getattr(wf, "__dict__", None)
    return (
        attrs is not None
        and not hasattr(wf, "__slots__")
        and not hasattr(cls, "__post_init__")
        and dataclasses.is_dataclass(cls)
        and all(f.default_factory is dataclasses.MISSING for f in dataclasses.fields(cls))
        and _SCALARS.issuperset(map(type, attrs.values()))
    )


def _copy(wf: Workflow) -> Workflow:
    """Return a shallow copy of a workflow that `_copyable` allows."""
    twin = object.__new__(type(wf))
    twin.__dict__.update(wf.__dict__)
    return twin


@dataclasses.dataclass(slots=True)
class _Twin:
    """What the starts of one type and input share: made once, each start is a copy of it.

    The workflow's data (a `_copyable` one: its JSON is the same for each copy), and its new
    state's JSON around the id, which alone differs.
    """

    wf: Workflow
    name: str
    data: str
    state: tuple[str, str]
    timeout: float | None
    #: `loaded`, bound once: every start of the twin waiting its turn shares it (no object
    #: of its own for the GC to scan while it waits).
    maker: Callable[[str], Loaded] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.maker = self.loaded

    @classmethod
    def of(cls, wf: Workflow, row: WorkflowRow, timeout: float | None) -> _Twin | None:
        """Return the twin of a workflow just built for `row`, or None if none can be made."""
        mark = msgspec.json.encode(uuid.uuid4().hex).decode()  # stands for the id, once
        before, found, after = State.new(mark[1:-1], row.name).to_json().partition(mark)
        if not found or mark in after:
            return None
        return cls(wf, row.name, row.data, (before, after), timeout)

    def make(self, wid: str, input: dict[str, Any] | None, now: float) -> Prepared:
        """Return a new start of this type and input, with id `wid`."""
        before, after = self.state
        deadline = None if self.timeout is None else now + self.timeout
        row = WorkflowRow(
            wid,
            self.name,
            _RESUMING,
            self.data,
            f"{before}{_encode(wid).decode()}{after}",
            deadline=deadline,
        )
        started: dict[str, Any] = {"input": input or {}}
        if deadline is not None:
            started["deadline"] = deadline
        return Prepared(row, [("started", started)], self.timeout, self.maker)

    def loaded(self, wid: str) -> Loaded:
        """Return the workflow in memory as a start of this twin with id `wid` wrote it."""
        return Loaded(_copy(self.wf), State.new(wid, self.name))


def _kept(loaded: Loaded) -> Callable[[str], Loaded]:
    """Return a maker of `loaded`, built already."""
    return lambda _: loaded


_RESUMING = WorkflowStatus.RESUMING.value
_encode = msgspec.json.Encoder().encode


def _cancelled_again(workflow_id: str, status: str) -> dict[str, Any]:
    """Answer a cancel of an ended workflow: harmless if Cancelled, a conflict otherwise."""
    if status == WorkflowStatus.CANCELLED.value:  # a retried cancel
        return {"workflow_id": workflow_id, "status": status}
    raise Conflict(f"workflow {workflow_id} has already ended: {status}")


def _a(name: str) -> str:
    """Return `name` with its indefinite article: "an Approval", "a Tally"."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _json_or_text(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


def log_findings(registry: Registry) -> int:
    """Log the definition checks of every registered workflow type; return how many."""
    count = 0
    for name, cls in sorted(registry.items()):
        try:
            findings = lint_workflow(cls)
        except Exception as e:  # noqa: BLE001 - checking must never stop the daemon
            findings = [Finding("error", "invalid", "", f"{type(e).__name__}: {e}")]
        for f in findings:
            count += 1
            emit = log.error if f.level == "error" else log.warning
            emit(
                f"lint_{f.level}", workflow=name, code=f.code, statement=f.statement, note=f.message
            )
    return count
