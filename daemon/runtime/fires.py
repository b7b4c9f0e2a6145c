"""What one schedule's fire does: give missed times up, apply the overlap policy, start.

The start commits the schedule's bookkeeping in the workflow's own transaction (the runtime's
start path with a `create` of ours), so a crash never loses or doubles a fire. Plain on-time
fires due together start together: built ahead (`prepare`), then written in one
transaction for all of them at their time (`commit`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from daemon.clock import Clock
from daemon.core.schedule import Plan, Schedule, iso, manual_id, plan, workflow_id
from daemon.core.state import FINAL_STATUSES
from daemon.errors import WorkflowdError
from daemon.observe.metrics import Metrics
from daemon.store.base import (
    EarlyFires,
    FireRecord,
    History,
    ScheduleFire,
    ScheduleUndo,
    Store,
    WorkflowRow,
)

log = structlog.get_logger()
FINAL = frozenset(s.value for s in FINAL_STATUSES)
#: One schedule starts at most one workflow per this: catch-ups and late fires are spread out.
SPACING_S = 0.2


class Start(Protocol):
    """The runtime's start path, with the write that commits the schedule's bookkeeping."""

    async def __call__(
        self,
        workflow: str,
        workflow_id: str | None = None,
        input: dict[str, Any] | None = None,
        *,
        create: Callable[[WorkflowRow, History], Awaitable[bool]] | None = None,
        quiet: bool = False,
    ) -> dict[str, Any]: ...


#: Writes many new workflows' rows at once; True for each inserted.
CreateMany = Callable[[Sequence[tuple[WorkflowRow, History]]], Awaitable[list[bool]]]


class Built(Protocol):
    """What a start built by the runtime shows: the row and history its launch writes."""

    @property
    def row(self) -> WorkflowRow: ...

    @property
    def history(self) -> History: ...


#: Builds many starts (type, id, input) ahead of their write: a `Built` start or the error each.
PrepareMany = Callable[[Sequence[tuple[str, str, dict[str, Any] | None]]], list[Any]]


class LaunchMany(Protocol):
    """Writes built starts with one `create`, then runs them: an answer or error each.

    With `not_before` they are kept, not run, until `BatchStart.release` (at that time).
    """

    async def __call__(
        self, prepared: Sequence[Any], *, create: CreateMany, not_before: float | None = None
    ) -> list[dict[str, Any] | Exception]: ...


#: The runtime's hand-over of workflows written ahead of their time: run them, or forget them.
Release = Callable[[Sequence[str]], None]


@dataclass(frozen=True, slots=True)
class BatchStart:
    """The runtime's batch start in two steps: build the workflows ahead, then write them.

    With `release` and `withdraw` (and a store that has `EarlyFires`), a large instant's
    fires may be written ahead of it and their workflows run at it.
    """

    prepare: PrepareMany
    launch: LaunchMany
    release: Release | None = None
    withdraw: Release | None = None
    #: Holds (True) or gives back (False) the runs' turns while an instant is written early.
    turns: Callable[[bool], None] | None = None


#: Cancels a workflow (the runtime's cancel).
Cancel = Callable[[str], Awaitable[Any]]
#: Returns a workflow's status, or None if it does not exist.
Status = Callable[[str], Awaitable[str | None]]
#: Tells whether a workflow is running now (has an actor).
Running = Callable[[str], bool]


def never(*_: object) -> bool:
    """Return False (the default for `running` and `held`)."""
    return False


@dataclass(eq=False)
class Entry:
    """One schedule's live state; its durable part mirrors the store's row."""

    schedule: Schedule
    last: float
    #: Nominal times before this were missed (the daemon, or this schedule, was not running).
    live_since: float
    paused: bool = False
    buffered: float | None = None
    last_workflow_id: str | None = None
    last_fire_at: float | None = None
    #: The heap entry that counts; older ones are skipped when popped.
    token: int = -1
    #: Set from the moment a fire is handed to a task until it is done.
    busy: bool = False
    #: The last workflow was seen ending (its actor exited in a final status): no need to ask.
    last_ended: bool = False
    held: bool = False
    #: When it last started a workflow (the spacing between starts).
    fired_at: float = -math.inf
    #: Its buffered fire may start: the workflow it waited for has stopped running.
    release_due: bool = False
    failures: int = 0
    #: Its fire committed ahead of the instant and not yet taken effect (see `Early`).
    early: Early | None = None
    # asyncio's lock, not anyio's: taken once per fire, and uncontended it never yields.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def plan(self, now: float) -> Plan:
        """Return what the schedule does next, as of `now`."""
        return plan(self.schedule, last=self.last, now=now, live_since=self.live_since)

    def next_due(self, now: float, spacing_s: float) -> float:
        """Return `due_at(plan(now))` without building the plan when nothing was missed."""
        s = self.schedule
        first = s.next_nominal(self.last)
        if first >= self.live_since:  # plan's on-time case
            return max(first + s.jitter(first), self.fired_at + spacing_s)
        return self.due_at(self.plan(now), spacing_s)

    def due_at(self, p: Plan, spacing_s: float) -> float:
        """Return when plan `p` is carried out: a start waits `spacing_s` after the last one."""
        if p.nominal is None:
            return p.at  # giving missed times up starts nothing: no spacing
        return max(p.at, self.fired_at + spacing_s)


class Firer:
    """Carries out fires; remembers which workflow each schedule waits for."""

    def __init__(
        self,
        *,
        store: Store,
        clock: Clock,
        start: Start,
        cancel: Cancel,
        status: Status,
        running: Running = never,
        spacing_s: float = SPACING_S,
        metrics: Metrics | None = None,
        batch: BatchStart | None = None,
    ) -> None:
        self._store, self._clock = store, clock
        self._metrics = metrics
        self._start, self._cancel, self._status, self._running = start, cancel, status, running
        self._batch = batch
        self._early = (
            store
            if isinstance(store, EarlyFires) and batch is not None and batch.release is not None
            else None
        )
        self.spacing_s = spacing_s
        #: A running workflow id -> the schedule whose buffered fire waits for it to end.
        self._waiting: dict[str, Entry] = {}
        #: Each schedule's last workflow id -> that schedule.
        self._last_of: dict[str, Entry] = {}

    def adopt(self, e: Entry) -> None:
        """Track a schedule loaded from the store."""
        if e.last_workflow_id is not None:
            self._last_of[e.last_workflow_id] = e

    def drop(self, e: Entry) -> None:
        """Stop tracking a schedule that is no longer registered."""
        self._last_of.pop(e.last_workflow_id or "", None)

    def exited(self, workflow_id: str, status: str | None) -> Entry | None:
        """Note that a workflow's actor exited; return the schedule whose buffered fire may go."""
        last = self._last_of.get(workflow_id)
        if last is not None and last.last_workflow_id == workflow_id:
            last.last_ended = status in FINAL
        e = self._waiting.pop(workflow_id, None)
        if e is not None:
            e.release_due = True
        return e

    async def act(self, e: Entry) -> None:
        """Do what the plan says now: give missed times up, skip or buffer on overlap, fire."""
        if e.paused:
            return
        if e.release_due:
            await self._release(e)
            e.release_due = False
        s, now = e.schedule, self._clock.now()
        p = e.plan(now)  # planned again under the lock: nothing moved it meanwhile
        if e.due_at(p, self.spacing_s) > now:
            return
        missed: list[FireRecord] = []
        if p.given_up:
            missed.append(
                FireRecord(
                    now, "skipped", nominal=p.given_up_until, reason="missed", count=p.given_up
                )
            )
            self._count(s.name, "skipped", p.given_up)
            log.info(
                "schedule_skipped",
                schedule=s.name,
                reason="missed",
                count=p.given_up,
                more=p.capped or None,
            )
        if p.nominal is None:
            assert p.given_up_until is not None
            await self._store.schedule_note(s.name, last_nominal=p.given_up_until, records=missed)
            e.last = max(e.last, p.given_up_until)
            return
        n = p.nominal
        running = await self._unfinished(e) if s.overlap != "allow" else None
        if running is not None and s.overlap == "cancel_other":
            await self._cancel_other(e, running)
        elif running is not None:
            buffer = s.overlap == "buffer_one" and e.buffered is None
            record = FireRecord(
                now,
                "buffered" if buffer else "skipped",
                nominal=n,
                reason=f"overlap: {running} still running",
            )
            await self._store.schedule_note(
                s.name, last_nominal=n, buffered=n if buffer else None, records=[*missed, record]
            )
            e.last = max(e.last, n)
            if buffer:
                e.buffered = n
                self._waiting[running] = e
            event = "schedule_buffered" if buffer else "schedule_skipped"
            self._count(s.name, "buffered" if buffer else "skipped")
            log.info(event, schedule=s.name, reason="overlap", nominal=iso(n), running=running)
            return
        await self.fire(e, n, "caught_up" if p.catch_up else "fired", missed)

    def _count(self, schedule: str, outcome: str, n: int = 1) -> None:
        if self._metrics is not None:
            self._metrics.schedule_fire(schedule, outcome, n)

    async def _unfinished(self, e: Entry) -> str | None:
        """Return the schedule's previous workflow if it has not ended yet."""
        wid = e.last_workflow_id
        if wid is None or (e.last_ended and not self._running(wid)):
            return None
        status = await self._status(wid)
        return wid if status is not None and status not in FINAL else None

    async def _cancel_other(self, e: Entry, running: str) -> None:
        try:
            await self._cancel(running)
        except WorkflowdError as ex:  # it ended (or was deleted) meanwhile: nothing to cancel
            log.info(
                "schedule_cancel_skipped", schedule=e.schedule.name, running=running, error=str(ex)
            )
            return
        log.info("schedule_cancelled_other", schedule=e.schedule.name, running=running)

    async def _release(self, e: Entry) -> None:
        """Start the buffered fire if the run it waited for has ended."""
        if e.buffered is None:
            return
        running = await self._unfinished(e)
        if running is not None:
            self._waiting[running] = e
            return
        await self.fire(e, e.buffered, "fired", [], from_buffer=True)

    async def fire(
        self,
        e: Entry,
        nominal: float | None,
        kind: str,
        records: list[FireRecord],
        *,
        from_buffer: bool = False,
    ) -> dict[str, Any]:
        """Start the schedule's workflow; the schedule's row commits with the workflow's."""
        s, now = e.schedule, self._clock.now()
        wid = manual_id(s.name, now) if nominal is None else workflow_id(s.name, nominal)
        fire = FireRecord(
            now, kind, nominal=nominal, workflow_id=wid, reason="buffered" if from_buffer else None
        )
        advance = nominal if kind != "manual" and not from_buffer else None
        about: dict[str, Any] = {"schedule": s.name}
        if nominal is not None:
            about["nominal"] = iso(nominal)
        committed = False

        async def create(row: WorkflowRow, history: History) -> bool:
            nonlocal committed
            created = await self._store.schedule_fire(
                s.name,
                row,
                [(kind_, {**detail, **about}) for kind_, detail in history],
                last_nominal=advance,
                clear_buffered=from_buffer,
                records=[*records, fire],
            )
            committed = True
            return created

        try:
            # Logged once, as `schedule_fired` (which names the workflow) below.
            result = await self._start(s.workflow, wid, s.input, create=create, quiet=True)
        finally:
            if committed:  # even if the start failed after the write, the fire is spent
                if advance is not None:
                    e.last = max(e.last, advance)
                if from_buffer:
                    e.buffered = None
                if e.last_workflow_id is not None:
                    self._last_of.pop(e.last_workflow_id, None)
                e.last_workflow_id, e.last_fire_at, e.fired_at = wid, now, now
                e.last_ended, self._last_of[wid] = False, e
        self._count(s.name, kind)
        late = round(now - nominal, 3) if nominal is not None else None
        log.info(
            "schedule_fired",
            schedule=s.name,
            workflow_id=wid,
            workflow=s.workflow,
            kind=kind,
            late_s=late,
            created=result.get("created"),
        )
        return result

    # -- many on-time fires at once ---------------------------------------------------------

    @property
    def batching(self) -> bool:
        """Tell whether on-time fires can be prepared and started in batches."""
        return self._batch is not None

    def batchable(self, e: Entry, p: Plan) -> bool:
        """Tell whether plan `p` is a plain start that can share one write with others.

        It is when nothing is given up, no buffered fire waits, and the overlap policy needs
        no question answered (`allow`, or the last run was seen ending).
        """
        if self._batch is None or p.nominal is None or p.given_up or e.release_due:
            return False
        wid = e.last_workflow_id
        return (
            e.schedule.overlap == "allow"
            or wid is None
            or (e.last_ended and not self._running(wid))
        )

    def prepare(self, batch: Sequence[tuple[Entry, Plan]]) -> Batch:
        """Build the workflows of many batchable plans, ahead of their time; nothing is written.

        A start that cannot be built (its input no longer fits, say) is kept as a failure.
        """
        assert self._batch is not None
        starts: list[tuple[str, str, dict[str, Any] | None]] = []
        fires: list[Ready] = []
        isos: dict[float, str] = {}  # the schedules of a batch mostly share their nominal time
        for e, p in batch:
            s, n = e.schedule, p.nominal
            assert n is not None
            at = isos.get(n)
            if at is None:
                at = isos[n] = iso(n)
            wid = workflow_id(s.name, n, at)
            starts.append((s.workflow, wid, s.input))
            fires.append(Ready(e, n, "caught_up" if p.catch_up else "fired", wid, at))
        out = Batch()
        for f, built in zip(fires, self._batch.prepare(starts), strict=True):
            if isinstance(built, Exception):
                out.failed.append((f.entry, built))
                continue
            b: Built = built
            name = f.entry.schedule.name
            for _, detail in b.history:  # its own entries, fresh: tagged in place
                detail["schedule"], detail["nominal"] = name, f.iso
            # The record's time is the store's, stamped in the transaction that writes it.
            record = FireRecord(0.0, f.kind, nominal=f.nominal, workflow_id=f.workflow_id)
            f.built, f.fire = (
                built,
                ScheduleFire(name, b.row, b.history, last_nominal=f.nominal, records=[record]),
            )
            out.ready.append(f)
        return out

    @property
    def early(self) -> bool:
        """Tell whether fires can be committed ahead of their instant (see `commit`)."""
        return self._early is not None

    async def commit(
        self, batch: Batch, not_before: float | None = None
    ) -> list[tuple[Entry, Exception]]:
        """Start a prepared batch's workflows in one transaction; return the failures.

        Each schedule's row and fire record commit with its workflow, as in `fire`. A start
        that could not be made is returned with its error; if the write itself fails, this
        raises and nothing was committed. With `not_before` (the fires' instant, still to
        come) the write is made now and the fires take effect at `release`: until then
        neither their workflows run nor the schedules' state here moves.
        """
        assert self._batch is not None
        about = {f.workflow_id: f for f in batch.ready}
        written: set[str] = set()
        early = self._early if not_before is not None else None

        async def create(rows: Sequence[tuple[WorkflowRow, History]]) -> list[bool]:
            fires = []
            for row, _ in rows:
                fire = about[row.id].fire
                assert fire is not None and fire.row is row  # built by `prepare`, stamped since
                fires.append(fire)
            if early is not None:
                assert not_before is not None
                created = await early.schedule_fire_early(fires, not_before)
            else:
                created = await self._store.schedule_fire_many(fires)
            written.update(row.id for row, _ in rows)
            return created

        results = await self._batch.launch(
            [f.built for f in batch.ready], create=create, not_before=not_before
        )
        if not_before is None:
            return self._took_effect(batch, written, results)
        batch.written, batch.results = written, results
        return []

    def hold_turns(self, held: bool) -> None:
        """Hold the runs' turns (True) while an instant's fires are built and written early."""
        if self._batch is not None and self._batch.turns is not None:
            self._batch.turns(held)

    def release(self, batch: Batch, now: float) -> list[tuple[Entry, Exception]]:
        """Let a batch committed ahead of its instant take effect (at it); return the failures.

        `now` is shared by the batches of the instant: their schedules' next times match.
        """
        assert self._batch is not None and self._batch.release is not None
        assert batch.results is not None
        self._batch.release([f.workflow_id for f in batch.ready])
        return self._took_effect(batch, batch.written, batch.results, now)

    async def undo(self, fires: Sequence[Ready], *, paused: str | None = None) -> list[bool]:
        """Take fires committed ahead of their instant back, in one transaction (and pause).

        True where taken back; False where its workflow moved meanwhile (a cancel), so that
        fire stands and is still to be released.
        """
        assert self._early is not None and self._batch is not None
        assert self._batch.withdraw is not None
        undos = [
            ScheduleUndo(
                f.entry.schedule.name,
                f.workflow_id,
                f.entry.last,
                f.entry.last_workflow_id,
                f.entry.last_fire_at,
            )
            for f in fires
        ]
        done = await self._early.schedule_undo(undos, paused=paused)
        self._batch.withdraw([f.workflow_id for f, gone in zip(fires, done, strict=True) if gone])
        return done

    def _took_effect(
        self,
        batch: Batch,
        written: set[str],
        results: Sequence[dict[str, Any] | Exception],
        now: float | None = None,
    ) -> list[tuple[Entry, Exception]]:
        """Move the schedules of a written batch on, log each fire; return the failures."""
        now = self._clock.now() if now is None else now
        failed = list(batch.failed)
        counted: list[tuple[str, str]] = []
        for f, result in zip(batch.ready, results, strict=True):
            e, wid = f.entry, f.workflow_id
            if wid in written:  # even if its start failed after the write, the fire is spent
                e.last = max(e.last, f.nominal)
                if e.last_workflow_id is not None:
                    self._last_of.pop(e.last_workflow_id, None)
                e.last_workflow_id, e.last_fire_at, e.fired_at = wid, now, now
                e.last_ended, self._last_of[wid] = False, e
            if isinstance(result, Exception):
                failed.append((e, result))
                continue
            counted.append((e.schedule.name, f.kind))
            log.info(
                "schedule_fired",
                schedule=e.schedule.name,
                workflow_id=wid,
                workflow=e.schedule.workflow,
                kind=f.kind,
                late_s=round(now - f.nominal, 3),
                created=result.get("created"),
            )
        if counted and self._metrics is not None:
            self._metrics.schedule_fires(counted)
        return failed


@dataclass(eq=False, slots=True)
class Ready:
    """One on-time fire of a batch: its schedule, nominal time and workflow, built ahead."""

    entry: Entry
    nominal: float
    kind: str
    workflow_id: str
    iso: str
    #: The runtime's built workflow (a `Built`), which its `launch` starts.
    built: Any = None
    #: What the store writes for it: the workflow's row and history, the schedule's advance.
    fire: ScheduleFire | None = None


@dataclass(eq=False, slots=True)
class Batch:
    """Fires prepared together: the ones ready to commit, and the ones that failed to build."""

    ready: list[Ready] = field(default_factory=list)
    failed: list[tuple[Entry, Exception]] = field(default_factory=list)
    #: Committed ahead of its instant: the ids written, and the starts' answers (`release`).
    written: set[str] = field(default_factory=set)
    results: list[dict[str, Any] | Exception] | None = None

    def entries(self) -> list[Entry]:
        """Return the schedules of the batch, ready or failed."""
        return [*(f.entry for f in self.ready), *(e for e, _ in self.failed)]


@dataclass(eq=False, slots=True)
class Early:
    """The batches of one instant committed ahead of it, until they take effect at `at`."""

    at: float
    batches: list[Batch] = field(default_factory=list)
    #: Set once they took effect (`Firer.release`): a pause from then on is a plain pause.
    released: bool = False
    #: Set when released: a trigger in the meantime waits for it.
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self, e: Entry) -> tuple[Ready, dict[str, Any] | Exception] | None:
        """Take a schedule's fire (and its start's answer) out, not to be released.

        None if it is not in, or the batch was released already.
        """
        if self.released:
            return None
        for b in self.batches:
            for i, f in enumerate(b.ready):
                if f.entry is e:
                    assert b.results is not None
                    result = b.results.pop(i)
                    del b.ready[i]
                    return f, result
        return None

    def put_back(self, f: Ready, result: dict[str, Any] | Exception) -> None:
        """Put a fire taken out back (its undo failed or did not apply): it is released."""
        b = Batch(ready=[f], written={f.workflow_id}, results=[result])
        self.batches.append(b)
