"""Recovery: every unfinished workflow is checked against the code, then resumed, re-armed or held.

The same check as a reload's (daemon.core.compat): a workflow that does not fit the code, or
whose row does not decode, is held with the reason rather than run into a failure, until a
reload, a restart or a repair makes it fit.

A store of many sleeping workflows starts fast: past the first CHECKED_AT_START, a workflow
that sleeps on timers and signals only is recovered lean, its timers armed from the deadlines
in its stored state (read by a small decoder) without loading its data or building its
definition. `check_rest` checks those against the code right after READY, a slice at a time;
one loaded before (its timer fires, an event comes) is checked at that load, before it runs.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import structlog

from daemon.core.compat import misfit
from daemon.core.handler import CallbackRequest
from daemon.core.state import FINAL_STATUSES, EventStatus, WorkflowStatus
from daemon.errors import WorkflowdError
from daemon.runtime.arming import SIGNAL, TIMER, Arms, Key, timer_deadline
from daemon.runtime.cache import Cache, Loaded
from daemon.runtime.scheduler import Scheduler
from daemon.runtime.work import Item
from daemon.store.base import EarlyFires, Sleepers, SleepingState, Store, WorkflowRow

log = structlog.get_logger()

#: Handler types a sleeping workflow may wait on and still be recovered lean: a timer (armed
#: from the deadline its setup stored) and a signal (nothing to arm).
LEAN_TYPES = frozenset({TIMER, SIGNAL})
#: How many sleeping workflows are checked in full before READY; the rest are recovered lean.
CHECKED_AT_START = 10_000
#: Workflows checked between two yields to the event loop in `check_rest` (~1-2 ms).
CHECK_SLICE = 64
_SETUP = EventStatus.SETUP.value


# What lean recovery reads of a stored State (daemon.core.state); msgspec skips the rest.
class _Req(msgspec.Struct):
    name: str
    pc: int
    setup_data: str = ""


class _Event(msgspec.Struct):
    type: str
    req: _Req
    status: str


class _Thread(msgspec.Struct):
    id: str
    wait_events: list[_Event] = []


class _Waits(msgspec.Struct):
    threads: list[_Thread] = []


_waits = msgspec.json.Decoder(_Waits)


def _timers_of(wid: str, state: str) -> list[tuple[Key, float]] | None:
    """Return a sleeping workflow's timers (key, deadline) from its state; None if it needs more.

    More: a wait is not set up, a thread waits on a condition, a wait's handler has a task or
    state of its own (not a timer or signal), or a timer's setup data does not decode.
    """
    try:
        waits = _waits.decode(state)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not waits.threads:
        return None
    timers = []
    for t in waits.threads:
        if not t.wait_events:
            return None  # it waits on a condition (or nothing): the full check decides
        for ev in t.wait_events:
            if ev.status != _SETUP or ev.type not in LEAN_TYPES:
                return None
            if ev.type == TIMER:
                due = timer_deadline(ev.req.setup_data)
                if due is None:
                    return None
                # Interned: a million sleepers share a handful of thread and event names.
                timers.append(((wid, sys.intern(t.id), sys.intern(ev.req.name), ev.req.pc), due))
    return timers


class Recovery:
    """Brings stored workflows into motion, or holds those that cannot run under this code."""

    def __init__(
        self,
        *,
        store: Store,
        cache: Cache,
        scheduler: Scheduler,
        arms: Arms,
        deadline: Callable[[str, float], None] = lambda workflow_id, at: None,
        sleepers: Sleepers | None = None,
        deferred: EarlyFires | None = None,
    ) -> None:
        self._store, self._cache, self._scheduler, self._arms = store, cache, scheduler, arms
        #: The store's reads of Waiting workflows apart, if it has them.
        self._sleepers = sleepers
        #: How many sleeping workflows are checked in full before READY (tests lower it).
        self.checked_at_start = CHECKED_AT_START
        #: Arms a workflow's deadline (`timeout_s`), which holds even while it is held.
        self._deadline = deadline
        #: The store's reads of workflows committed ahead of their time, if it has them.
        self._deferred = deferred
        #: Of the workflows being recovered, those not to run before a time to come: id -> it.
        self._not_before: dict[str, float] = {}
        #: Their resumes, one timer per time (a batch shares one), and the ids each resumes.
        self._later: dict[float, list[str]] = {}
        #: The ids in `_later`: workflows that have not started yet (no event reaches them).
        self.deferred: set[str] = set()

    async def recover(self) -> None:
        """Pick up every unfinished workflow: resume runnable ones, re-arm waiting ones.

        Each is checked against the code first; one that does not fit is held with the reason.
        """
        counts = dict.fromkeys(("resumed", "armed", "broken", "incompatible", "held"), 0)
        if self._deferred is not None:
            # Committed ahead of their time (a schedule's large instant) by a daemon that
            # stopped before it: each runs at its time, not before.
            self._not_before = await self._deferred.deferred_starts(time.time())
        pending = await self._store.inbox_pending()
        unseen = {p.workflow_id for p in pending}
        if self._sleepers is None or self._scheduler.hold.held:
            async for row in self._store.unfinished():
                unseen.discard(row.id)
                counts[await self.recover_one(row)] += 1
        else:
            async for row in self._sleepers.awake():
                unseen.discard(row.id)
                counts[await self.recover_one(row)] += 1
            after = ""
            async for page in self._sleepers.sleeping(limit=self.checked_at_start):
                for row in page:
                    unseen.discard(row.id)
                    counts[await self.recover_one(row)] += 1
                after = page[-1].id
            await self._recover_lean(after, counts, unseen)
        # Ids that are not unfinished: ended ones reject their events; missing ones cannot.
        gone = {wid for wid in unseen if await self._store.get(wid) is None}
        dropped: list[int] = []
        for pending_row in pending:
            if pending_row.workflow_id in gone:
                log.warning(
                    "inbox_dropped",
                    inbox_id=pending_row.id,
                    workflow_id=pending_row.workflow_id,
                    event_name=pending_row.event,
                    reason="no such workflow",
                )
                dropped.append(pending_row.id)
                continue
            req = CallbackRequest(
                pending_row.workflow_id, pending_row.thread_id, pending_row.event, pending_row.pc
            )
            self._scheduler.submit(
                pending_row.workflow_id,
                Item("callback", req=req, input=pending_row.input, inbox_id=pending_row.id),
            )
        if dropped:
            await self._store.inbox_done(dropped)
        self._not_before = {}
        log.info("recovered", **counts, unchecked=len(self._cache.unchecked))

    def _resume_at(self, workflow_id: str, at: float) -> None:
        """Resume a workflow at `at` (epoch seconds), not before."""
        ids = self._later.get(at)
        if ids is None:
            ids = self._later[at] = []
            delay = max(0.0, at - time.time())
            asyncio.get_running_loop().call_later(delay, self._resume_due, at)
        ids.append(workflow_id)
        self.deferred.add(workflow_id)

    def _resume_due(self, at: float) -> None:
        if time.time() < at:  # the wall clock stepped back meanwhile: still not before it
            asyncio.get_running_loop().call_later(at - time.time(), self._resume_due, at)
            return
        for wid in self._later.pop(at, ()):
            self.deferred.discard(wid)
            if not self._scheduler.stopping:  # a stop leaves it Resuming, for the next start
                self._scheduler.submit(wid, Item("resume"))

    async def _recover_lean(self, after: str, counts: dict[str, int], unseen: set[str]) -> None:
        """Arm the timers of the Waiting workflows with an id over `after` from their states.

        The next page is read while this one is armed; one that needs more than its state
        (see `_timers_of`) is recovered in full.
        """
        assert self._sleepers is not None
        sleepers = self._sleepers
        send, receive = anyio.create_memory_object_stream[list[SleepingState]](1)

        async def read(start: str) -> None:
            async with send:
                async for page in sleepers.sleeping_states(after=start):
                    await send.send(page)

        # The pass makes millions of small objects that all stay alive: the cyclic collector
        # would walk them again and again (a fifth of the pass) and free none.
        collecting = gc.isenabled()
        gc.disable()
        try:
            async with anyio.create_task_group() as tg, receive:
                tg.start_soon(read, after)
                async for page in receive:
                    rest = self._arm_page(page, unseen)
                    counts["armed"] += len(page) - len(rest)
                    if rest:
                        # The page again, in full (one read, not one per row); a row that is no
                        # longer Waiting was picked up by whatever changed it.
                        want = set(rest)
                        async for rows in sleepers.sleeping(after=after, limit=len(page)):
                            for row in rows:
                                if row.id in want:
                                    counts[await self.recover_one(row)] += 1
                    after = page[-1][0]
        finally:
            if collecting:
                gc.enable()

    def _arm_page(self, page: list[SleepingState], unseen: set[str]) -> list[str]:
        """Arm a page of sleeping workflows lean; return the ids that need a full recovery."""
        registry, cached, unchecked = self._cache.registry, self._cache.get, self._cache.unchecked
        timers: list[tuple[Key, float]] = []
        rest = []
        for wid, name, deadline, state in page:
            if unseen:
                unseen.discard(wid)
            found = None
            if name in registry and cached(wid) is None:
                found = _timers_of(wid, state)
            if found is None:
                rest.append(wid)
                continue
            if deadline is not None:
                self._deadline(wid, deadline)
            unchecked.add(wid)
            timers += found
        self._arms.arm_timers(timers)
        return rest

    async def check_rest(self) -> None:
        """Check the workflows recovered lean against the code, a slice at a time.

        It runs once, right after READY; an I/O error is logged and the pass goes on later
        (each one left is still checked when it is first loaded).
        """
        if self._sleepers is None or not self._cache.unchecked:
            return
        counts = dict.fromkeys(("checked", "broken", "incompatible"), 0)
        delay = 1.0
        while self._cache.unchecked:
            try:
                async for page in self._sleepers.sleeping():
                    for i, row in enumerate(page):
                        if i % CHECK_SLICE == 0:
                            await anyio.lowlevel.checkpoint()  # let requests in
                        if row.id not in self._cache.unchecked:
                            continue
                        self._cache.unchecked.discard(row.id)
                        counts["checked"] += 1
                        outcome = self._check(row)
                        if outcome is not None:
                            counts[outcome] += 1
                            self._scheduler.park_queued(row.id)
                # Left: they are no longer Waiting (woken, ended), so they were checked then.
                self._cache.unchecked.clear()
            except Exception as e:  # noqa: BLE001 - e.g. an I/O error: each is checked at load
                log.error("recovery_check_failed", error=f"{type(e).__name__}: {e}")
                await anyio.sleep(delay)
                delay = min(delay * 2, 60.0)
        log.info("recovery_checked", **counts)

    def _check(self, row: WorkflowRow) -> str | None:
        """Hold a workflow that does not decode or fit the code; say which, or None if it fits."""
        return self._decoded(row)[1]

    def _decoded(self, row: WorkflowRow) -> tuple[Loaded | None, str | None]:
        """Decode a row and check it against the code: (loaded, None), or hold it and say why."""
        try:
            loaded = self._cache.decode(row)
        except WorkflowdError as e:
            self._hold_unfit(row, str(e))
            log.error("workflow_corrupt", workflow_id=row.id, workflow=row.name, error=str(e))
            return None, "broken"
        reason = misfit(self._cache.registry, row.name, row.data, loaded.state)
        if reason is None:
            return loaded, None
        self._hold_unfit(row, reason)
        log.error("workflow_incompatible", workflow_id=row.id, workflow=row.name, reason=reason)
        return None, "incompatible"

    def vet(self, row: WorkflowRow, loaded: Loaded) -> bool:
        """Check a workflow recovered lean against the code at its first load; False if held.

        What was queued for it is parked then (a cancel stays), as for any held workflow.
        """
        reason = misfit(self._cache.registry, row.name, row.data, loaded.state)
        if reason is None:
            return True
        self._hold_unfit(row, reason)
        log.error("workflow_incompatible", workflow_id=row.id, workflow=row.name, reason=reason)
        self._scheduler.park_queued(row.id)
        return False

    async def recover_one(self, row: WorkflowRow) -> str:
        """Resume or re-arm one unfinished workflow that fits the code; return what was done.

        "resumed" or "armed"; "held" by `workflowd --hold`; "incompatible" (it does not fit
        the code) or "broken" (its row does not decode, or its waits cannot be armed).
        """
        hold = self._scheduler.hold
        self._cache.unchecked.discard(row.id)  # checked here
        if row.deadline is not None:
            self._deadline(row.id, row.deadline)
        loaded, unfit = self._decoded(row)
        if loaded is None:
            assert unfit is not None
            return unfit
        if hold.incompatible.pop(row.id, None) is not None:
            # A copy an actor loaded meanwhile (to find it held) holds the old class.
            self._cache.forget(row.id)
            log.info("workflow_fits", workflow_id=row.id, workflow=row.name)
        if hold.holds(row.id):
            return "held"
        state = loaded.state
        needs_setup = any(
            ev.status is not EventStatus.SETUP for t in state.threads for ev in t.wait_events
        )
        if state.status is WorkflowStatus.RESUMING or needs_setup:
            self._cache.remember(loaded)
            at = self._not_before.pop(row.id, None)
            if at is not None and state.status is WorkflowStatus.RESUMING:
                self._resume_at(row.id, at)
            else:
                self._scheduler.submit(row.id, Item("resume"))
            return "resumed"
        try:
            self._arms.rearm(loaded.wf, loaded.state)
        except Exception as e:  # noqa: BLE001 - one bad definition must not stop recovery
            log.error("workflow_rearm_failed", workflow_id=row.id, error=str(e))
            return "broken"
        return "armed"

    def _hold_unfit(self, row: WorkflowRow, reason: str) -> None:
        """Hold a workflow that cannot run under this code: nothing armed, nothing resumed."""
        self._scheduler.hold.incompatible[row.id] = reason
        self._arms.disarm_workflow(row.id)

    async def refit(self) -> list[dict[str, Any]]:
        """Check the workflows held as unfit against the code now registered; return the rest.

        One that fits now is released (armed, resumed, and its parked events applied).
        """
        hold, still = self._scheduler.hold, []
        for wid in list(hold.incompatible):
            # A repair changing it checks it against this code itself; an actor on a held
            # workflow can only be cancelling it.
            if wid in hold.busy or self._scheduler.running(wid):
                continue
            row = await self._store.get(wid)
            if row is None or row.status in FINAL_STATUSES:  # cancelled meanwhile
                hold.incompatible.pop(wid, None)
                continue
            await self.recover_one(row)
            reason = hold.incompatible.get(wid)
            if reason is None:
                self._scheduler.unpark(wid)
            else:
                still.append({"workflow_id": wid, "workflow": row.name, "reason": reason})
        return still
