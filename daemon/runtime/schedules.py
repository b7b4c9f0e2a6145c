"""The schedules' firing loop: one heap of next fires, the tasks that carry them out, and the
control socket's list, show, pause, resume and trigger.

It gets its collaborators explicitly (the store, the clock, the runtime's start and cancel, a
workflow's status, whether `--hold` holds) and never sees the runtime. What to do next is
decided by `daemon.core.schedule.plan`; what a fire does is `daemon.runtime.fires`.
"""

from __future__ import annotations

import asyncio
import builtins
import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import structlog

from daemon.clock import Clock
from daemon.core.schedule import Plan, Schedule, iso, plan
from daemon.errors import ScheduleNotFound
from daemon.observe.metrics import Metrics
from daemon.runtime.fires import (
    SPACING_S,
    Batch,
    BatchStart,
    Cancel,
    Early,
    Entry,
    Firer,
    Ready,
    Running,
    Start,
    Status,
    never,
)
from daemon.store.base import Store

log = structlog.get_logger()
#: A wake-up later than this, while the wall clock ran ahead of the monotonic one by as much,
#: means the machine slept or the clock jumped: what came due meanwhile was missed, and follows
#: each schedule's catch-up policy. (A loop that is merely busy falls behind on both clocks;
#: its fires are late, not missed.)
LATE_GRACE_S = 2.0
#: The loop reads the wall clock at least this often: its sleeps are monotonic, so a suspend
#: or a clock change would otherwise go unseen until a long sleep ends.
MAX_SLEEP_S = 60.0
#: While `workflowd --hold` holds, each schedule looks again this often.
HOLD_RECHECK_S = 1.0
#: Tasks that carry out fires, started as needed and then kept: many fires due at once go to
#: the store together (one group commit), and handing one to a waiting task costs a fraction
#: of starting a task for it.
MAX_WORKERS = 4096
#: On-time fires due in one loop turn go to the store together, this many per transaction:
#: one write a batch instead of one a fire, and the first ones commit while the rest are made.
BATCH_MAX = 500
#: On-time fires are built up to this long before they are due (their ids, workflows and
#: rows), so that at the due instant only their write is left; nothing is written before
#: then but a large instant's fires (EARLY_OVER_S), whose workflows still run at it. An
#: `every=1` schedule is built again as soon as its last fire took effect.
PREPARE_S = 1.0
#: Fires are built ahead this many at a time (~50 ms of the loop), the loop's other work
#: running between.
PREPARE_SLICE = 2000
#: An instant whose fires would take longer than this to commit has them committed ahead of
#: it (`Schedules._lead`), so that they are durable at the instant; its workflows still run
#: at it, not before. Smaller instants (a lone nightly schedule) commit at it, as always.
EARLY_OVER_S = 0.010
#: The commit time per fire assumed until one is measured (~33 us of SQLite work, measured).
COMMIT_PER_FIRE_S = 50e-6
#: How much longer than the measured commit time the lead is (the runs' writes compete).
EARLY_FACTOR, EARLY_MARGIN_S = 2.0, 0.020
RETRY_INITIAL_S, RETRY_MAX_S = 1.0, 60.0


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
        running: Running = never,
        held: Callable[[], bool] = never,
        schedules: Mapping[str, Schedule] | None = None,
        grace_s: float = LATE_GRACE_S,
        spacing_s: float = SPACING_S,
        metrics: Metrics | None = None,
        batch: BatchStart | None = None,
    ) -> None:
        self._store, self._clock, self._status, self._held = store, clock, status, held
        self._grace = grace_s
        self._metrics = metrics
        self._fires = Firer(
            store=store,
            clock=clock,
            start=start,
            cancel=cancel,
            status=status,
            running=running,
            spacing_s=spacing_s,
            metrics=metrics,
            batch=batch,
        )
        self._wanted: dict[str, Schedule] = dict(schedules or {})
        self._changed = True
        self._entries: dict[str, Entry] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._ready: asyncio.Queue[Entry] = asyncio.Queue()
        self._workers = self._idle = 0
        self._tg: anyio.abc.TaskGroup | None = None
        #: A commit's time per fire, as measured by the last early commit (see `_lead_for`).
        self._commit_s = COMMIT_PER_FIRE_S
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
        e = self._fires.exited(workflow_id, status)
        if e is not None and self._entries.get(e.schedule.name) is e:
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
            batch: list[tuple[Entry, Plan]] = []
            made: list[Batch] = []
            while self._heap and self._heap[0][0] <= now:
                _, token, name = heapq.heappop(self._heap)
                e = self._entries.get(name)
                if e is None or e.token != token:
                    continue
                p = self._step(e, now)
                if p is None:
                    continue
                await e.lock.acquire()  # free (`_step` checked), so this rarely waits
                if e.paused or e.token != token or not self._fires.batchable(e, p):
                    # A pause, resume (a new token) or trigger got the lock first: decide
                    # again, alone.
                    e.lock.release()
                    self._hand(e)
                else:
                    batch.append((e, p))
                    if len(batch) >= BATCH_MAX:
                        made.append(self._fires.prepare(batch))
                        batch = []
            if batch:
                made.append(self._fires.prepare(batch))
            if made:
                self._fire_due(now, made)
            lead = self._lead()
            if lead:
                self._take_ahead(now + lead)
            deadline = min(self._heap[0][0] - lead if self._heap else math.inf, now + MAX_SLEEP_S)
            await self._nap(deadline)

    def _lead(self) -> float:
        """Return how long before their time fires are prepared (0: they are not)."""
        return PREPARE_S if self._fires.batching and not self._held() else 0.0

    def _take_ahead(self, until: float) -> None:
        """Take the schedules due by `until` off the heap, to be prepared by their time."""
        groups: dict[float, list[tuple[Entry, int]]] = {}
        while self._heap and self._heap[0][0] <= until:
            at, token, name = heapq.heappop(self._heap)
            e = self._entries.get(name)
            if e is not None and e.token == token:
                groups.setdefault(at, []).append((e, token))
        for at, group in groups.items():
            self._spawn(self._prepared, at, group)

    async def _prepared(self, at: float, group: builtins.list[tuple[Entry, int]]) -> None:
        """Build the on-time fires of a group due at `at`, then write them at `at` (or, for
        a large instant, ahead of it: `_lead_for`).

        A schedule that changed meanwhile (a pause, a trigger, a reload, its last run
        ending) or that is not a plain on-time start is handed back at `at` and decided
        then as any due schedule; one that was put back in the heap meanwhile is left to it.
        While a large instant is built and written, the runs of earlier fires get at most
        ADMIT_HELD turns at once (not ADMIT_MAX): its fires have the loop and the writer first.
        """
        large = self._lead_for(len(group)) > 0
        if large:
            self._fires.hold_turns(True)
        turns = [large]  # the turns are held while it builds and writes, not while it waits
        try:
            await self._prepare_and_write(at, group, turns)
        finally:
            if turns[0]:
                self._fires.hold_turns(False)

    async def _prepare_and_write(
        self, at: float, group: builtins.list[tuple[Entry, int]], turns: builtins.list[bool]
    ) -> None:
        ready: builtins.list[tuple[Entry, int, Plan, tuple[Any, ...]]] = []
        back: builtins.list[tuple[Entry, int]] = []
        for e, token in group:
            p = e.plan(at)
            plain = not (e.busy or e.paused or e.held or p.catch_up)
            if plain and e.due_at(p, self._fires.spacing_s) <= at and self._fires.batchable(e, p):
                ready.append((e, token, p, _seen(e)))
            else:
                back.append((e, token))
        batches: builtins.list[Batch] = []
        try:
            for i in range(0, len(ready), BATCH_MAX):
                if i and i % PREPARE_SLICE == 0:
                    await anyio.lowlevel.checkpoint()  # building 10,000 takes a while
                chunk = [(e, p) for e, _, p, _ in ready[i : i + BATCH_MAX]]
                batches.append(self._fires.prepare(chunk))
        except Exception:  # noqa: BLE001 - decided at its time, where a failure is logged and retried
            batches, back = [], [*back, *((e, token) for e, token, _, _ in ready)]
        lead = self._lead_for(len(ready))
        if turns[0] and at - lead > self._clock.now():
            turns[0] = False
            self._fires.hold_turns(False)
            await self._clock.sleep_until(at - lead)
            self._fires.hold_turns(True)
            turns[0] = True
        await self._clock.sleep_until(at - lead)
        # Built too late to be early (the loop is behind), a large instant still commits
        # and takes effect as one: its schedules stay one group for the next instant.
        # Nothing is durable before its time, but for a large instant's fires, committed
        # `lead` ahead of it (their workflows run at it): from here they are checked and
        # written.
        valid = {id(e): (token, seen) for e, token, _, seen in ready}
        held = self._held()
        pending = Batch()
        out: builtins.list[Batch] = []
        for b in batches:
            back += [(e, valid[id(e)][0]) for e, _ in b.failed]  # decided again, alone
            for f in b.ready:
                e = f.entry
                token, seen = valid[id(e)]
                if e.token != token:
                    continue  # put back in the heap meanwhile: decided there
                if held or e.busy or e.paused or e.lock.locked() or _seen(e) != seen:
                    back.append((e, token))
                    continue
                e.busy = True
                await e.lock.acquire()  # free (checked just above): this never waits
                pending.ready.append(f)
                if len(pending.ready) >= BATCH_MAX:  # each batch runs its workflows once written
                    out.append(pending)
                    pending = Batch()
        if pending.ready:
            out.append(pending)
        if lead and out:
            early = await self._commit_all(at, out)
            self._spawn(self._take_effect, early)
        else:
            for b in out:
                self._spawn(self._fire_batch, b)
        now = self._clock.now()
        for e, token in back:
            if e.token == token:
                self._push(e, now)

    def _fire_due(self, now: float, made: builtins.list[Batch]) -> None:
        """Write batches of fires found due (late: the loop is behind, or not built ahead).

        Many (a large instant the loop fell behind on) commit and take effect as one, as an
        early instant does, so that their schedules stay one group for the next instant
        (one slice at a time they would come back, and be built, a slice at a time).
        """
        if self._lead_for(sum(len(b.ready) for b in made)) == 0.0:
            for b in made:
                self._spawn(self._fire_batch, b)
            return
        for b in made:
            for e, error in b.failed:  # decided again, alone (it holds its lock)
                e.lock.release()
                self._failed(e, error)
                e.busy = False
            b.failed = []
        self._spawn(self._fire_group, now, made)

    async def _fire_group(self, at: float, made: builtins.list[Batch]) -> None:
        self._fires.hold_turns(True)
        try:
            early = await self._commit_all(at, made)
        finally:
            self._fires.hold_turns(False)
        await self._take_effect(early)

    def _lead_for(self, fires: int) -> float:
        """Return how long before their instant these many on-time fires are committed.

        0 (at the instant, as always) unless their commit would take over EARLY_OVER_S;
        else twice the measured commit time and a margin, at most PREPARE_S.
        """
        cost = fires * self._commit_s
        if not self._fires.early or cost <= EARLY_OVER_S or self._held():
            return 0.0
        return min(PREPARE_S, EARLY_MARGIN_S + EARLY_FACTOR * cost)

    async def _commit_all(self, at: float, batches: builtins.list[Batch]) -> Early:
        """Commit an instant's batches now, ahead of it (`_take_effect` lets them at `at`).

        Their locks are held until written, then the schedules stay busy (nothing else fires
        them) until `at`. A pause or a reload meanwhile takes its fire back (`_take_back`);
        a trigger waits for `at`; a stop leaves them durable, for recovery to run at `at`.
        """
        early = Early(at)
        began, ahead = time.monotonic(), at - self._clock.now()
        async with anyio.create_task_group() as tg:
            for b in batches:
                tg.start_soon(self._commit_early, early, b)
        fires = sum(len(b.ready) for b in early.batches)
        if fires:
            took = time.monotonic() - began
            self._commit_s = (self._commit_s + took / fires) / 2
            log.info(
                "schedules_committed_early",
                count=fires,
                took_s=round(took, 3),
                began_ahead_s=round(ahead, 3),
                ahead_s=round(at - self._clock.now(), 3),
            )
        return early

    async def _take_effect(self, early: Early) -> None:
        """Let an instant's fires committed early take effect at it: their workflows run."""
        try:
            await self._clock.sleep_until(early.at)
        finally:
            early.released = True
            early.done.set()
        now = self._clock.now()  # one for all: their next times match, they stay one group
        for b in early.batches:
            self._settle(b, self._fires.release(b, now), now)

    async def _commit_early(self, early: Early, batch: Batch) -> None:
        """Commit one batch ahead of its instant (its locks are held); a failure is decided
        again at the instant, alone."""
        entries = batch.entries()
        try:
            await self._fires.commit(batch, not_before=early.at)
        except Exception as ex:  # noqa: BLE001 - e.g. disk full: each is tried on its own
            log.warning(
                "schedule_batch_failed", count=len(entries), error=f"{type(ex).__name__}: {ex}"
            )
            for e in entries:
                e.lock.release()
                self._hand(e)  # still busy: a worker takes it at its time (it plans again)
            return
        except BaseException:
            for e in entries:
                e.lock.release()
                e.busy = False
            raise
        early.batches.append(batch)
        for e in entries:
            e.early = early
            e.lock.release()

    def _settle(
        self, batch: Batch, failed: builtins.list[tuple[Entry, Exception]], now: float
    ) -> None:
        """Free the schedules of a batch that took effect; put each back for its next time."""
        errors = {id(e): error for e, error in failed}
        for e in batch.entries():
            e.busy, e.early = False, None
            error = errors.get(id(e))
            if error is not None:
                self._failed(e, error)
                continue
            e.failures = 0
            # Put back for when it is due next (planned again then, as it is popped).
            self._push(e, now if e.release_due else e.next_due(now, self._fires.spacing_s))

    async def _take_back(self, entries: builtins.list[Entry], paused: str | None = None) -> bool:
        """Take back the fires these schedules committed ahead of an instant still to come.

        In one transaction, with `paused` paused in it. A fire released meanwhile, or whose
        workflow a cancel reached, stands (it takes effect as any). Return whether every one
        was taken back.
        """
        taken = []
        for e in entries:
            early = e.early
            got = early.take(e) if early is not None else None
            if early is not None and got is not None:
                taken.append((e, early, *got))
        if not taken:
            return False
        try:
            done = await self._fires.undo([f for _, _, f, _ in taken], paused=paused)
        except BaseException:
            for e, early, f, result in taken:
                self._stands(e, early, f, result)
            raise
        for (e, early, f, result), gone in zip(taken, done, strict=True):
            if gone:
                e.busy, e.early = False, None
                log.info(
                    "schedule_fire_taken_back", schedule=e.schedule.name, nominal=iso(f.nominal)
                )
            else:
                self._stands(e, early, f, result)
        return all(done)

    def _stands(self, e: Entry, early: Early, f: Ready, result: dict[str, Any] | Exception) -> None:
        """Put a fire that could not be taken back back: it takes effect at its instant."""
        if not early.released:
            early.put_back(f, result)
            return
        b = Batch(ready=[f], written={f.workflow_id}, results=[result])
        now = self._clock.now()
        self._settle(b, self._fires.release(b, now), now)

    async def _sync(self) -> None:
        """Load the state of schedules new to this loop; drop the ones no longer wanted."""
        self._changed = False
        wanted = self._wanted
        now = self._clock.now()
        new = [name for name in wanted if name not in self._entries]
        rows = {r.name: r for r in await self._store.schedules_load(new, now)} if new else {}
        # A fire committed ahead of its instant for a schedule dropped or changed is taken back.
        changed = [
            e
            for name, e in self._entries.items()
            if e.early is not None
            and (name not in wanted or not e.schedule.fires_like(wanted[name]))
        ]
        if changed:
            await self._take_back(changed)
        for name in [n for n in self._entries if n not in wanted]:
            self._fires.drop(self._entries.pop(name))
        for name, s in wanted.items():
            e = self._entries.get(name)
            if e is None:
                r = rows[name]
                e = self._entries[name] = Entry(
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
                self._fires.adopt(e)
            e.schedule = s
            self._push(e, now)
        log.info("schedules_loaded", count=len(wanted), new=len(new))

    def _push(self, e: Entry, at: float) -> None:
        e.token = next(self._seq)
        heapq.heappush(self._heap, (at, e.token, e.schedule.name))
        if at - PREPARE_S < self._nap_until:  # the loop may want it earlier, to prepare it
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

    def _step(self, e: Entry, now: float) -> Plan | None:
        """Hand a due schedule to a task, or put it back for when it is due.

        A plain on-time start whose lock is free is returned instead, to go in a batch.
        """
        if e.busy or e.paused:
            return None
        if self._held():
            e.held = True
            self._push(e, now + HOLD_RECHECK_S)
            return None
        if e.held:  # released from `--hold`: what came due meanwhile was missed
            e.held, e.live_since = False, max(e.live_since, now)
        p = e.plan(now)
        at = e.due_at(p, self._fires.spacing_s)
        if at > now and not e.release_due:
            self._push(e, at)
            return None
        e.busy = True
        if not e.lock.locked() and self._fires.batchable(e, p):
            return p
        self._hand(e)
        return None

    def _hand(self, e: Entry) -> None:
        """Queue a busy schedule for a worker task, starting one if none is idle."""
        self._ready.put_nowait(e)
        if self._ready.qsize() > self._idle and self._workers < MAX_WORKERS:
            self._workers += 1
            self._spawn(self._worker)

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, *args)

    async def _fire_batch(self, batch: Batch) -> None:
        """Fire a prepared batch in one write (its locks are held); a failed write fires each
        alone."""
        entries = batch.entries()
        try:
            failed = await self._fires.commit(batch)
        except Exception as ex:  # noqa: BLE001 - e.g. disk full: each is tried on its own
            log.warning(
                "schedule_batch_failed", count=len(entries), error=f"{type(ex).__name__}: {ex}"
            )
            for e in entries:
                e.lock.release()
                self._hand(e)  # still busy: a worker takes it, and backs off if it fails too
            return
        except BaseException:  # cancelled (shutdown): a waiting pause or trigger still gets in
            for e in entries:
                e.lock.release()
                e.busy = False
            raise
        for e in entries:
            e.lock.release()
        self._settle(batch, failed, self._clock.now())

    async def _worker(self) -> None:
        while True:
            self._idle += 1
            try:
                e = await self._ready.get()
            finally:
                self._idle -= 1
            await self._guarded(e)

    async def _guarded(self, e: Entry) -> None:
        """Act under the schedule's lock; a failure is logged and retried with backoff."""
        try:
            async with e.lock:
                await self._fires.act(e)
            e.failures = 0
            self._push(e, self._clock.now())  # plan again at once
        except Exception as ex:  # noqa: BLE001 - a failed fire is retried, never ends the loop
            self._failed(e, ex)
        finally:
            e.busy = False

    def _failed(self, e: Entry, ex: Exception) -> None:
        """Log a failed fire and try it again after a backoff."""
        e.failures += 1
        delay = _backoff(e.failures)
        log.error(
            "schedule_fire_failed",
            schedule=e.schedule.name,
            error=f"{type(ex).__name__}: {ex}",
            retry_in_s=delay,
        )
        self._push(e, self._clock.now() + delay)

    # -- what the control socket calls ------------------------------------------------------

    def _entry(self, name: str) -> Entry:
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
        if e.early is not None:  # a fire committed ahead of its instant is not shown before it
            now = self._clock.now()
            fires = [f for f in fires if f.at <= now]
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

    async def _summary(self, e: Entry) -> dict[str, Any]:
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

    def _next_at(self, e: Entry) -> float | None:
        now = self._clock.now()
        p = e.plan(now)
        if p.nominal is None:  # missed times are given up first, then this one starts
            assert p.given_up_until is not None
            p = plan(e.schedule, last=p.given_up_until, now=now, live_since=e.live_since)
        at = e.due_at(p, self._fires.spacing_s)
        at = max(at, now) if p.catch_up else at
        return at if math.isfinite(at) else None

    async def pause(self, name: str) -> dict[str, Any]:
        """Stop firing a schedule (durably) until `resume`."""
        e = self._entry(name)
        if e.early is not None and not e.paused and await self._take_back([e], paused=name):
            e.paused = True  # in the transaction that took its early fire back
            log.info("schedule_paused", schedule=name)
            return {"name": name, "paused": True}
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
        if e.early is not None:  # its fire takes effect first (its instant is under a second off)
            await e.early.done.wait()
        async with e.lock:
            result = await self._fires.fire(e, None, "manual", [])
        return {"name": name, **result}


def _seen(e: Entry) -> tuple[Any, ...]:
    """Return what a prepared fire was decided on: if it changed, the fire is decided again."""
    return (e.last, e.live_since, e.fired_at, e.last_workflow_id, e.release_due, e.buffered)


def _backoff(failures: int) -> float:
    return float(min(RETRY_INITIAL_S * 2 ** max(0, failures - 1), RETRY_MAX_S))
