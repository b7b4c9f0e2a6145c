"""The schedules' firing loop: one heap of next fires, catch-up after downtime, overlap policies.

It gets its collaborators explicitly (the store, the clock, the runtime's start and cancel, a
workflow's status, whether `--hold` holds) and never sees the runtime. What to do next is
decided by `daemon.core.schedule.plan`; this module does the waiting and the writing.
"""

from __future__ import annotations

import asyncio
import builtins
import heapq
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
import structlog

from daemon.clock import Clock
from daemon.core.schedule import Plan, Schedule, iso, manual_id, plan, workflow_id
from daemon.core.state import FINAL_STATUSES
from daemon.errors import ScheduleNotFound, WorkflowdError
from daemon.store.base import FireRecord, History, Store, WorkflowRow

log = structlog.get_logger()
FINAL = frozenset(s.value for s in FINAL_STATUSES)
#: A wake-up later than this, while the wall clock ran ahead of the monotonic one by as much,
#: means the machine slept or the clock jumped: what came due meanwhile was missed, and follows
#: each schedule's catch-up policy. (A loop that is merely busy falls behind on both clocks;
#: its fires are late, not missed.)
LATE_GRACE_S = 2.0
#: The loop reads the wall clock at least this often: its sleeps are monotonic, so a suspend
#: or a clock change would otherwise go unseen until a long sleep ends.
MAX_SLEEP_S = 60.0
#: One schedule starts at most one workflow per this: catch-ups and late fires are spread out.
SPACING_S = 0.2
#: While `workflowd --hold` holds, each schedule looks again this often.
HOLD_RECHECK_S = 1.0
#: Tasks that carry out fires, started as needed and then kept: many fires due at once go to
#: the store together (one group commit), and handing one to a waiting task costs a fraction
#: of starting a task for it.
MAX_WORKERS = 512
RETRY_INITIAL_S, RETRY_MAX_S = 1.0, 60.0


class Start(Protocol):
    """The runtime's start path, with the write that commits the schedule's bookkeeping."""

    async def __call__(
        self,
        workflow: str,
        workflow_id: str | None = None,
        input: dict[str, Any] | None = None,
        *,
        create: Callable[[WorkflowRow, History], Awaitable[bool]] | None = None,
    ) -> dict[str, Any]: ...


#: Cancels a workflow (the runtime's cancel).
Cancel = Callable[[str], Awaitable[Any]]
#: Returns a workflow's status, or None if it does not exist.
Status = Callable[[str], Awaitable[str | None]]
#: Tells whether a workflow is running now (has an actor).
Running = Callable[[str], bool]


def _never(*_: object) -> bool:
    return False


@dataclass(eq=False)
class _Entry:
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
    # asyncio's lock, not anyio's: taken once per fire, and uncontended it never yields.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Schedules:
    """Fires the registered schedules; the control socket lists, pauses, resumes and triggers."""

    def __init__(
        self,
        *,
        store: Store,
        clock: Clock,
        start: Start,
        cancel: Cancel,
        status: Status,
        running: Running = _never,
        held: Callable[[], bool] = _never,
        schedules: Mapping[str, Schedule] | None = None,
        grace_s: float = LATE_GRACE_S,
        spacing_s: float = SPACING_S,
    ) -> None:
        self._store, self._clock = store, clock
        self._start, self._cancel, self._status, self._held = start, cancel, status, held
        self._running = running
        self._grace, self._spacing = grace_s, spacing_s
        self._wanted: dict[str, Schedule] = dict(schedules or {})
        self._changed = True
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        #: A running workflow id -> the schedule whose buffered fire waits for it to end.
        self._waiting: dict[str, str] = {}
        #: Each schedule's last workflow id -> that schedule.
        self._last_of: dict[str, _Entry] = {}
        self._ready: asyncio.Queue[_Entry] = asyncio.Queue()
        self._workers = self._idle = 0
        self._tg: anyio.abc.TaskGroup | None = None
        self._nap_scope: anyio.CancelScope | None = None
        self._nap_until = math.inf
        #: The wall and monotonic clocks when the loop last woke.
        self._mark = (clock.now(), time.monotonic())

    # -- the loop ---------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Load the schedules' state, report started, then fire them until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await self._sync()
            task_status.started()
            try:
                await self._loop()
            finally:
                self._tg = None

    def configure(self, schedules: Mapping[str, Schedule]) -> None:
        """Use these schedules from now on (a reload); a removed one keeps its stored state."""
        self._wanted, self._changed = dict(schedules), True
        self._wake()

    def workflow_exited(self, workflow_id: str, status: str | None = None) -> None:
        """Note that a workflow's actor exited (in `status`): a buffered fire may wait for it."""
        last = self._last_of.get(workflow_id)
        if last is not None and last.last_workflow_id == workflow_id:
            last.last_ended = status in FINAL
        name = self._waiting.pop(workflow_id, None)
        e = self._entries.get(name) if name is not None else None
        if e is not None:
            e.release_due = True
            self._push(e, self._clock.now())

    async def _loop(self) -> None:
        failures = 0
        while True:
            if self._changed:
                try:
                    await self._sync()
                    failures = 0
                except Exception as ex:  # noqa: BLE001 - e.g. disk full: retried, never fatal
                    failures += 1
                    self._changed = True
                    delay = _backoff(failures)
                    log.error(
                        "schedules_load_failed",
                        error=f"{type(ex).__name__}: {ex}",
                        retry_in_s=delay,
                    )
                    await self._nap(self._clock.now() + delay)
                    continue
            now = self._clock.now()
            while self._heap and self._heap[0][0] <= now:
                _, token, name = heapq.heappop(self._heap)
                e = self._entries.get(name)
                if e is not None and e.token == token:
                    self._step(e, now)
            deadline = min(self._heap[0][0] if self._heap else math.inf, now + MAX_SLEEP_S)
            await self._nap(deadline)

    async def _sync(self) -> None:
        """Load the state of schedules new to this loop; drop the ones no longer wanted."""
        self._changed = False
        wanted = self._wanted
        now = self._clock.now()
        new = [name for name in wanted if name not in self._entries]
        rows = {r.name: r for r in await self._store.schedules_load(new, now)} if new else {}
        for name in [n for n in self._entries if n not in wanted]:
            gone = self._entries.pop(name)
            self._last_of.pop(gone.last_workflow_id or "", None)
        for name, s in wanted.items():
            e = self._entries.get(name)
            if e is None:
                r = rows[name]
                e = self._entries[name] = _Entry(
                    s,
                    r.last_nominal,
                    live_since=now,
                    paused=r.paused,
                    buffered=r.buffered,
                    last_workflow_id=r.last_workflow_id,
                    last_fire_at=r.last_fire_at,
                    # Its running workflow may have ended while the daemon was down.
                    release_due=r.buffered is not None,
                )
                if e.last_workflow_id is not None:
                    self._last_of[e.last_workflow_id] = e
            e.schedule = s
            self._push(e, now)
        log.info("schedules_loaded", count=len(wanted), new=len(new))

    def _push(self, e: _Entry, at: float) -> None:
        e.token = next(self._seq)
        heapq.heappush(self._heap, (at, e.token, e.schedule.name))
        if at < self._nap_until:
            self._wake()

    def _wake(self) -> None:
        if self._nap_scope is not None:
            self._nap_scope.cancel()

    async def _nap(self, deadline: float) -> None:
        """Sleep until `deadline` or a wake-up; then notice a suspend or a clock jump."""
        with anyio.CancelScope() as scope:
            self._nap_scope, self._nap_until = scope, deadline
            await self._clock.sleep_until(deadline)
        self._nap_scope, self._nap_until = None, math.inf
        now, mono = self._clock.now(), time.monotonic()
        drift = (now - self._mark[0]) - (mono - self._mark[1])
        self._mark = (now, mono)
        if drift > self._grace and now - deadline > self._grace:
            log.warning("schedules_clock_jumped", ahead_s=round(drift, 3))
            for e in self._entries.values():
                e.live_since = max(e.live_since, now)

    def _step(self, e: _Entry, now: float) -> None:
        """Hand a due schedule to a task, or put it back for when it is due."""
        if e.busy or e.paused:
            return
        if self._held():
            e.held = True
            self._push(e, now + HOLD_RECHECK_S)
            return
        if e.held:  # released from `--hold`: what came due meanwhile was missed
            e.held, e.live_since = False, max(e.live_since, now)
        at = self._due_at(e, self._plan(e, now))
        if at > now and not e.release_due:
            self._push(e, at)
            return
        e.busy = True
        self._ready.put_nowait(e)
        if self._ready.qsize() > self._idle and self._workers < MAX_WORKERS:
            assert self._tg is not None
            self._workers += 1
            self._tg.start_soon(self._worker)

    async def _worker(self) -> None:
        while True:
            self._idle += 1
            try:
                e = await self._ready.get()
            finally:
                self._idle -= 1
            await self._guarded(e)

    def _plan(self, e: _Entry, now: float) -> Plan:
        return plan(e.schedule, last=e.last, now=now, live_since=e.live_since)

    def _due_at(self, e: _Entry, p: Plan) -> float:
        if p.nominal is None:
            return p.at  # giving missed times up starts nothing: no spacing
        return max(p.at, e.fired_at + self._spacing)

    async def _guarded(self, e: _Entry) -> None:
        """Act under the schedule's lock; a failure is logged and retried with backoff."""
        try:
            async with e.lock:
                await self._act(e)
            e.failures = 0
            self._push(e, self._clock.now())  # plan again at once
        except Exception as ex:  # noqa: BLE001 - a failed fire is retried, never ends the loop
            e.failures += 1
            delay = _backoff(e.failures)
            log.error(
                "schedule_fire_failed",
                schedule=e.schedule.name,
                error=f"{type(ex).__name__}: {ex}",
                retry_in_s=delay,
            )
            self._push(e, self._clock.now() + delay)
        finally:
            e.busy = False

    # -- what a fire does -------------------------------------------------------------------

    async def _act(self, e: _Entry) -> None:
        """Do what the plan says now: give missed times up, skip or buffer on overlap, fire."""
        if e.paused:
            return
        if e.release_due:
            await self._release(e)
            e.release_due = False
        s, now = e.schedule, self._clock.now()
        p = self._plan(e, now)  # planned again under the lock: nothing moved it meanwhile
        if self._due_at(e, p) > now:
            return
        missed: list[FireRecord] = []
        if p.given_up:
            missed.append(
                FireRecord(
                    now, "skipped", nominal=p.given_up_until, reason="missed", count=p.given_up
                )
            )
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
                self._waiting[running] = s.name
            event = "schedule_buffered" if buffer else "schedule_skipped"
            log.info(event, schedule=s.name, reason="overlap", nominal=iso(n), running=running)
            return
        await self._fire(e, n, "caught_up" if p.catch_up else "fired", missed)

    async def _unfinished(self, e: _Entry) -> str | None:
        """Return the schedule's previous workflow if it has not ended yet."""
        wid = e.last_workflow_id
        if wid is None or (e.last_ended and not self._running(wid)):
            return None
        status = await self._status(wid)
        return wid if status is not None and status not in FINAL else None

    async def _cancel_other(self, e: _Entry, running: str) -> None:
        try:
            await self._cancel(running)
        except WorkflowdError as ex:  # it ended (or was deleted) meanwhile: nothing to cancel
            log.info(
                "schedule_cancel_skipped", schedule=e.schedule.name, running=running, error=str(ex)
            )
            return
        log.info("schedule_cancelled_other", schedule=e.schedule.name, running=running)

    async def _release(self, e: _Entry) -> None:
        """Start the buffered fire if the run it waited for has ended."""
        if e.buffered is None:
            return
        running = await self._unfinished(e)
        if running is not None:
            self._waiting[running] = e.schedule.name
            return
        await self._fire(e, e.buffered, "fired", [], from_buffer=True)

    async def _fire(
        self,
        e: _Entry,
        nominal: float | None,
        kind: str,
        records: builtins.list[FireRecord],
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
            result = await self._start(s.workflow, wid, s.input, create=create)
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

    # -- what the control socket calls ------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            known = ", ".join(sorted(self._entries)) or "none"
            raise ScheduleNotFound(f"no schedule {name!r} (known: {known})")
        return e

    async def list(self) -> builtins.list[dict[str, Any]]:
        """Summarize every schedule, by name."""
        return [await self._summary(self._entries[n]) for n in sorted(self._entries)]

    async def show(self, name: str) -> dict[str, Any]:
        """Return one schedule: its settings, its state and its last fires."""
        e = self._entry(name)
        s = e.schedule
        fires = await self._store.schedule_fires(name)
        return {
            **await self._summary(e),
            "cron": s.cron,
            "every": s.every,
            "input": s.input,
            "catchup": s.catchup,
            "catchup_window_s": s.catchup_window_s,
            "jitter_s": s.jitter_s,
            "overlap": s.overlap,
            "last_nominal_at": e.last,
            "buffered_at": e.buffered,
            "fires": [
                {
                    "at": f.at,
                    "kind": f.kind,
                    "nominal_at": f.nominal,
                    "workflow_id": f.workflow_id,
                    "reason": f.reason,
                    "count": f.count,
                }
                for f in fires
            ],
        }

    async def _summary(self, e: _Entry) -> dict[str, Any]:
        s = e.schedule
        status = await self._status(e.last_workflow_id) if e.last_workflow_id else None
        return {
            "name": s.name,
            "workflow": s.workflow,
            "spec": s.spec,
            "tz": s.tz,
            "next_fire_at": None if e.paused else self._next_at(e),
            "last_fire_at": e.last_fire_at,
            "last_workflow_id": e.last_workflow_id,
            "last_status": status,
            "paused": e.paused,
        }

    def _next_at(self, e: _Entry) -> float | None:
        now = self._clock.now()
        p = self._plan(e, now)
        if p.nominal is None:  # missed times are given up first, then this one starts
            assert p.given_up_until is not None
            p = plan(e.schedule, last=p.given_up_until, now=now, live_since=e.live_since)
        at = max(self._due_at(e, p), now) if p.catch_up else self._due_at(e, p)
        return at if math.isfinite(at) else None

    async def pause(self, name: str) -> dict[str, Any]:
        """Stop firing a schedule (durably) until `resume`."""
        e = self._entry(name)
        async with e.lock:
            if not e.paused:
                await self._store.schedule_note(name, paused=True)
                e.paused = True
                log.info("schedule_paused", schedule=name)
        return {"name": name, "paused": True}

    async def resume(self, name: str) -> dict[str, Any]:
        """Fire a paused schedule again; what it missed meanwhile follows its catch-up policy."""
        e = self._entry(name)
        async with e.lock:
            if e.paused:
                await self._store.schedule_note(name, paused=False)
                now = self._clock.now()
                e.paused, e.live_since = False, max(e.live_since, now)
                log.info("schedule_resumed", schedule=name)
                self._push(e, now)
        return {"name": name, "paused": False}

    async def trigger(self, name: str) -> dict[str, Any]:
        """Start the schedule's workflow now, once, whatever its overlap policy or pause."""
        e = self._entry(name)
        async with e.lock:
            result = await self._fire(e, None, "manual", [])
        return {"name": name, **result}


def _backoff(failures: int) -> float:
    return float(min(RETRY_INITIAL_S * 2 ** max(0, failures - 1), RETRY_MAX_S))
