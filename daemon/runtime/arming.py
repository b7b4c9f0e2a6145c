"""Armed waits: one heap for every timer, one task per active handler, nothing else."""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import structlog

from daemon.clock import Clock, SystemClock
from daemon.core.definition import Definable, Definition
from daemon.core.handler import CallbackRequest, Deliver, Handler
from daemon.core.state import FINAL_STATUSES, EventStatus, State
from daemon.observe.metrics import Metrics
from daemon.runtime.supervise import RETRY_INITIAL_S, RETRY_MAX_S, supervise

log = structlog.get_logger()

#: An armed wait: workflow id, thread id, event name, pc.
Key = tuple[str, str, str, int]
#: Submits a listener's callback for an armed wait; `wait` says whether to await its result.
Submit = Callable[[CallbackRequest, Any, bool], Coroutine[Any, Any, Any]]
#: Reports that an armed wait's listener failed (not its delivery), with the error text.
#: It must not block: it only queues work.
Broken = Callable[[CallbackRequest, str], None]
#: Hands a due timer's callback (its request and input) to its workflow; nobody waits for an
#: answer. It must not block: the timer loop hands over every due timer in one go.
Fire = Callable[[CallbackRequest, Any], None]

LISTEN_RETRY_MAX_S = 60.0
#: Handler types whose waits hold this machine's resources (a path, a port): on a shared
#: database their workflow is pinned to the node that set them up.
NODE_LOCAL = frozenset({"file", "socket"})
REFUSED_GRACE_S = 0.25
#: Timers handed over per loop turn. A wake that finds thousands due (the loop fell behind)
#: held the loop for tens of ms handing them all over (measured: up to 58 ms); between
#: batches the workflows already handed theirs run, and the socket is read.
FIRE_BATCH = 64
#: Timers fire on a grid of this step (wall clock): every timer due within one step fires in
#: one wake at its end, as systemd's AccuracySec and the kernel's timer slack coalesce. Each
#: wake of the loop costs about as much as a timer's own work (the wake of the step worker
#: and of the writer after it included): at 2,000 fires a second, 1 ms takes a fifth of the
#: loop's CPU per fire off, for 0.5 ms more lateness on average and 1 ms at most.
GRID_S = 0.001


#: Wait types recovery arms without their handler: a timer from the deadline its setup stored
#: (`timer_deadline`; re-arming after a resume does the same), a signal with nothing to arm.
TIMER, SIGNAL = "timer", "signal"
_SETUP = EventStatus.SETUP


def _on_grid(deadline: float) -> float:
    """Return when a timer due at `deadline` fires: the end of its step of the grid."""
    return math.ceil(deadline / GRID_S) * GRID_S


def key_of(req: CallbackRequest) -> Key:
    """Return the key of the wait `req` addresses."""
    return (req.workflow_id, req.thread_id, req.name, req.pc)


class _Deadline(msgspec.Struct):
    """What a Timer's setup stores (handlers.timer): the absolute deadline, epoch seconds."""

    deadline: float


_deadline_of = msgspec.json.Decoder(_Deadline)


def timer_deadline(setup_data: str) -> float | None:
    """Return the deadline a timer's setup stored, or None if its setup data does not say."""
    try:
        return _deadline_of.decode(setup_data).deadline
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class Arms:
    """Keeps the timers and listen tasks of every armed wait, and fires them."""

    def __init__(
        self,
        tg: anyio.abc.TaskGroup,
        clock: Clock,
        submit: Submit,
        broken: Broken,
        metrics: Metrics | None = None,
        *,
        fire: Fire,
    ) -> None:
        self._tg, self._clock, self._submit, self._broken = tg, clock, submit, broken
        self._fire = fire
        self._metrics = metrics
        # Ties on the deadline compare keys, which are plain tuples: no sequence number needed.
        self._heap: list[tuple[float, Key]] = []
        self._timers: dict[Key, float] = {}
        self._listeners: dict[Key, anyio.CancelScope] = {}
        self._delivering: set[Key] = set()
        #: A workflow's armed keys: the key itself while it is the only one (most are), so a
        #: million sleeping workflows hold no set each.
        self._by_workflow: dict[str, Key | set[Key]] = {}
        self._local: set[Key] = set()
        self._sleep: anyio.CancelScope | None = None  # the timer loop's current sleep
        self._sleeping_until = math.inf
        # The flat path (the system clock): one loop callback due at the earliest deadline,
        # moved when an earlier timer is armed; no task wakes, no sleep or scope per wake.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.Handle | None = None
        #: When `_handle` is due (epoch seconds); -inf while it is a batch's next turn or a
        #: retry's backoff, which an earlier timer does not cut short.
        self._handle_due = math.inf
        self._failures = 0

    def __len__(self) -> int:
        return len(self._timers) + len(self._listeners)

    def next_due(self) -> float:
        """Return when (epoch seconds) the earliest timer may fire; inf with none armed."""
        # The heap may still hold a disarmed entry on top: never later than the real one.
        return self._heap[0][0] if self._heap else math.inf

    def kinds(self) -> dict[str, int]:
        """Count the armed waits by kind: `timer` or `listener` (an active handler's task)."""
        return {"timer": len(self._timers), "listener": len(self._listeners)}

    def pinned(self) -> set[str]:
        """Return the workflows with a node-local wait armed here (a FileWatch, a SocketListen)."""
        return {key[0] for key in self._local}

    def armed(self, workflow_id: str) -> set[Key]:
        """Return the keys armed for one workflow."""
        have = self._by_workflow.get(workflow_id)
        if have is None:
            return set()
        return set(have) if isinstance(have, set) else {have}

    def sync(self, workflow_id: str, wanted: dict[Key, tuple[CallbackRequest, Handler]]) -> None:
        """Make the armed waits of one workflow exactly `wanted`."""
        for key in self.armed(workflow_id) - wanted.keys():
            self.disarm(key)
        for key, (req, handler) in wanted.items():
            if key not in self._timers and key not in self._listeners:
                self._arm(key, req, handler)

    def rearm(
        self, wf: Definable, state: State, definition: Definition | None = None
    ) -> Definition | None:
        """Make the armed waits of a workflow match its state.

        Runs after every callback and resume, so it is cheap for timers: a wait armed already
        stays, and a new timer is armed from the deadline its setup stored (as recovery does),
        without building the definition. Any other wait not armed builds it: a listener needs
        its handler; a signal arms nothing, but building the definition after a callback is
        also what finds data, left by a handler, that the definition can no longer be built
        from, before that is saved (the callback is answered with the error, nothing kept).
        `definition`, if given, is the one built from the data as it is now (no build then).
        Returns the Definition used, if one was (for the caller to pass on), else `definition`.
        """
        wid, timers, listeners = state.id, self._timers, self._listeners
        keep: set[Key] = set()
        new_timers: list[tuple[Key, float]] = []
        new: list[tuple[Key, CallbackRequest]] = []
        if state.status not in FINAL_STATUSES:
            for t in state.threads:
                for ev in t.wait_events:
                    if ev.status is not _SETUP:
                        continue
                    req = ev.req
                    key = (wid, t.id, req.name, req.pc)
                    if key in timers or key in listeners:
                        keep.add(key)
                    elif ev.type == TIMER and (due := timer_deadline(req.setup_data)) is not None:
                        new_timers.append((key, due))
                    else:
                        new.append((key, req))
        have = self._by_workflow.get(wid)
        if have is not None:
            for key in set(have) if isinstance(have, set) else (have,):
                if key not in keep:
                    self.disarm(key)
        if new_timers:
            self.arm_timers(new_timers)
        if new:
            # Building the definition is the costly part, hence only here.
            if definition is None:
                definition = Definition(wf.definition())
            events = definition.events
            for key, req in new:
                on = events.get(req.name)
                if on is not None:
                    self._arm(key, req, on.handler)
        return definition

    def _arm(self, key: Key, req: CallbackRequest, handler: Handler) -> None:
        deadline_of = getattr(handler, "deadline", None)
        listen = getattr(handler, "listen", None)
        if deadline_of is not None:
            self.arm_timer(key, float(deadline_of(req)))
            return
        if listen is not None:
            scope = anyio.CancelScope()
            self._listeners[key] = scope
            if getattr(handler, "type", "") in NODE_LOCAL:
                self._local.add(key)
            self._tg.start_soon(self._listen, key, req, listen, scope)
        else:
            return
        self._index(key)

    def _index(self, key: Key) -> None:
        wid = key[0]
        have = self._by_workflow.get(wid)
        if have is None:
            self._by_workflow[wid] = key
        elif isinstance(have, set):
            have.add(key)
        elif have != key:
            self._by_workflow[wid] = {have, key}

    def _unindex(self, key: Key) -> None:
        wid = key[0]
        have = self._by_workflow.get(wid)
        if isinstance(have, set):
            have.discard(key)
            if len(have) == 1:
                self._by_workflow[wid] = next(iter(have))
            elif not have:
                del self._by_workflow[wid]
        elif have == key:
            del self._by_workflow[wid]

    def arm_timer(self, key: Key, deadline: float) -> None:
        """Arm a timer due at `deadline` (epoch seconds); one armed already stays as it is.

        Recovery arms a sleeping workflow's timers this way, from their stored deadlines,
        without building its definition.
        """
        self.arm_timers(((key, deadline),))

    def arm_timers(self, timers: Iterable[tuple[Key, float]]) -> None:
        """Arm many timers, each (key, deadline); one armed already stays as it is."""
        armed, heap, push, by_workflow = self._timers, self._heap, heapq.heappush, self._by_workflow
        for key, deadline in timers:
            if armed.setdefault(key, deadline) is not deadline:
                continue  # armed already
            push(heap, (deadline, key))
            if key[0] in by_workflow:
                self._index(key)
            else:
                by_workflow[key[0]] = key
        if heap:
            if _on_grid(heap[0][0]) < self._handle_due and self._loop is not None:
                self._call_at_earliest()
            elif self._sleep is not None and heap[0][0] < self._sleeping_until:
                self._sleep.cancel()

    def disarm(self, key: Key) -> None:
        """Stop a timer or cancel a listen task; a listener that is delivering may finish.

        If that delivery is refused, the listener ends REFUSED_GRACE_S later (see `_listen`).
        """
        if self._timers.pop(key, None) is not None:
            self._compact()
        scope = self._listeners.pop(key, None)
        self._local.discard(key)
        if scope is not None and key not in self._delivering:
            scope.cancel()
        self._unindex(key)

    def _compact(self) -> None:
        """Drop disarmed timers from the heap once they outnumber the armed ones."""
        # They are skipped when popped, but a loop whose signal keeps beating a long
        # timeout would otherwise grow the heap by one entry per round until each is due.
        if len(self._heap) > 2 * len(self._timers) + 64:
            self._heap = [e for e in self._heap if self._timers.get(e[1]) == e[0]]
            heapq.heapify(self._heap)

    def disarm_workflow(self, workflow_id: str) -> None:
        """Disarm every wait of one workflow."""
        for key in self.armed(workflow_id):
            self.disarm(key)

    async def _listen(
        self,
        key: Key,
        req: CallbackRequest,
        listen: Callable[[CallbackRequest, Deliver], Awaitable[None]],
        scope: anyio.CancelScope,
    ) -> None:
        refused: list[BaseException] = []

        async def deliver(value: Any) -> Any:
            self._delivering.add(key)
            try:
                return await self._submit(req, value, True)
            except Exception as e:
                refused.append(e)
                if self._listeners.get(key) is not scope:
                    # Disarmed while delivering and refused: the wait is gone, so end the
                    # listener once it had a moment to answer its client.
                    scope.deadline = min(scope.deadline, anyio.current_time() + REFUSED_GRACE_S)
                raise
            finally:
                self._delivering.discard(key)

        delay = 1.0
        with scope:
            while True:
                try:
                    await listen(req, deliver)
                    return
                except Exception as e:  # noqa: BLE001 - a broken listener is retried, never fatal
                    if self._listeners.get(key) is not scope:
                        return  # disarmed: it failed because its wait is gone
                    error = f"{type(e).__name__}: {e}"
                    log.warning(
                        "listen_failed",
                        workflow_id=req.workflow_id,
                        event_name=req.name,
                        error=error,
                        retry_in_s=delay,
                    )
                    if not any(e is r for r in refused):
                        # The watch itself could not be (re)opened, e.g. after a restart: a
                        # setup error, shown and retried like one. Its actor disarms us then;
                        # until it does (or if the wait moved on), this loop keeps retrying.
                        self._broken(req, error)
                refused.clear()
                await anyio.sleep(delay)
                delay = min(delay * 2, LISTEN_RETRY_MAX_S)

    async def run_timers(self) -> None:
        """Fire every timer when its deadline passes; runs until cancelled."""
        if type(self._clock) is SystemClock:
            await self._run_flat()
        else:
            # Any other clock (a test's FakeClock) is waited on through its `sleep_until`.
            await supervise("timers", self._fire_due, self._until_due)

    async def _run_flat(self) -> None:
        """Fire timers from one loop callback due at the earliest deadline, until cancelled.

        The callback hands over a batch and returns; nothing awaits per wake. A failure is
        retried as `supervise` retries one: logged, backed off, the timer kept armed.
        """
        self._loop = asyncio.get_running_loop()
        try:
            self._call_at_earliest()
            await self._loop.create_future()  # held until cancelled: the callback does the work
        finally:
            if self._handle is not None:
                self._handle.cancel()
            self._loop, self._handle, self._handle_due = None, None, math.inf

    def _call_at_earliest(self) -> None:
        """(Re)schedule the callback for the earliest armed deadline (none: no callback)."""
        loop = self._loop
        assert loop is not None
        if self._handle is not None:
            self._handle.cancel()
        heap = self._heap
        if not heap:
            self._handle, self._handle_due = None, math.inf
            return
        at = self._handle_due = _on_grid(heap[0][0])
        # Wall-clock deadline onto the loop's monotonic clock, as a sleep of the rest would.
        self._handle = loop.call_at(loop.time() + (at - time.time()), self._on_due)

    def _on_due(self) -> None:
        """Hand over one batch of due timers; then the next batch's turn or the next deadline."""
        loop = self._loop
        if loop is None:
            return  # stopped meanwhile
        self._handle, self._handle_due = None, math.inf
        try:
            more = self._fire_batch(self._clock.now())
        except Exception as e:  # noqa: BLE001 - the timers must never stop: retried as supervise does
            self._failures += 1
            delay = min(RETRY_INITIAL_S * 2 ** (self._failures - 1), RETRY_MAX_S)
            log.error(
                "task_failed",
                task="timers",
                error=f"{type(e).__name__}: {e}",
                failures=self._failures,
                retry_in_s=delay,
            )
            self._handle, self._handle_due = loop.call_later(delay, self._on_due), -math.inf
            return
        if self._failures:
            log.info("task_recovered", task="timers", failures=self._failures)
            self._failures = 0
        if more:
            # The next batch after one loop turn: what this one handed over runs first, and
            # the socket is read.
            self._handle, self._handle_due = loop.call_soon(self._on_due), -math.inf
        else:
            self._call_at_earliest()

    async def _until_due(self) -> None:
        """Return once the earliest timer is due, or a new timer may be earlier.

        One cancel scope per sleep, no task: arming an earlier timer cancels the scope.
        """
        with anyio.CancelScope() as scope:
            self._sleep = scope
            if not self._heap:
                self._sleeping_until = math.inf
                await anyio.sleep_forever()
            else:
                self._sleeping_until = self._heap[0][0]
                await self._clock.sleep_until(self._sleeping_until)
        self._sleep = None

    async def _fire_due(self) -> None:
        """Hand every timer due now to its workflow, in deadline order, in this one wake.

        No task and no await per timer; a loop turn after every FIRE_BATCH of them.
        """
        now = self._clock.now()
        while self._fire_batch(now):
            await anyio.lowlevel.checkpoint()

    def _fire_batch(self, now: float) -> bool:
        """Hand up to FIRE_BATCH timers due by `now` over, in deadline order; True if more are.

        No task and no await per timer: a burst of due timers stays cheap.
        """
        heap, armed, fire, by_workflow = self._heap, self._timers, self._fire, self._by_workflow
        pop, lateness, left = heapq.heappop, [], FIRE_BATCH
        try:
            while heap and heap[0][0] <= now:
                if not left:
                    return True
                entry = pop(heap)
                due, key = entry
                if armed.get(key) != due:
                    continue  # disarmed or re-armed since
                try:
                    fire(CallbackRequest(*key), {"deadline": due, "fired_at": now})
                except BaseException:
                    # Still armed: it is tried again after the backoff.
                    heapq.heappush(heap, entry)
                    raise
                del armed[key]
                if by_workflow.get(key[0]) == key:
                    del by_workflow[key[0]]  # its only armed wait (most are)
                else:
                    self._unindex(key)
                lateness.append(now - due)
                left -= 1
            return False
        finally:
            if lateness and self._metrics is not None:
                self._metrics.timers_fired(lateness)
