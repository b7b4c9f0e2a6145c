"""Worker threads for sync steps: long-lived, fed from one queue, waking the loop once a batch."""

from __future__ import annotations

import asyncio
import contextvars
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from daemon.observe.threads import name_os_thread
from daemon.wake import LoopBell

T = TypeVar("T")
#: How long a job must have run before its thread counts as blocked, and another is woken for
#: the jobs queued behind it: twice the interpreter's GIL switch interval (5 ms), so that a
#: thread that only waits for the GIL behind a busy loop does not count.
BLOCKED_S = 0.01


@dataclass(slots=True, eq=False)
class Job:
    """A sync action queued for a worker thread; its result comes back through `future`."""

    fn: Callable[[], Any]
    context: contextvars.Context
    future: asyncio.Future[Any]
    done: _Completions
    #: It holds one of the pool's slots: taken by a thread, neither finished nor given up.
    holding: bool = False
    #: Given up on (`Workers.forget`): no thread starts it, and it holds no slot.
    gone: bool = False


class _Completions:
    """Finished jobs of one event loop, handed back to it with one wake-up per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._finished: deque[tuple[asyncio.Future[Any], bool, Any]] = deque()
        self._wake_pending = False
        # Rung from the worker thread holding the GIL (see LoopBell): the loop's wake costs
        # the worker no hand-off of the GIL before it takes its next job or sleeps.
        self._wake = LoopBell(loop, self._deliver)

    def put(self, future: asyncio.Future[Any], ok: bool, value: Any) -> None:
        """Queue a result (from a worker thread); wake the loop unless a wake-up is on its way."""
        self._finished.append((future, ok, value))
        if not self._wake_pending:
            self._wake_pending = True
            if self.loop.is_closed() or not self._wake.ring():  # nobody awaits these any more
                self._finished.clear()

    def close(self) -> None:
        """Close the pipe of a loop that is closed (results for it are dropped from now on)."""
        self._wake.close()

    def _deliver(self) -> None:
        self._wake.clear()
        # Reset first: a result queued while this runs schedules its own (maybe empty) round.
        self._wake_pending = False
        while self._finished:
            future, ok, value = self._finished.popleft()
            if future.cancelled():  # the step was given up on (timeout, cancel): drop it
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)


class Workers:
    """A pool of threads that run sync step actions: few awake, more only while steps block.

    anyio.to_thread costs a thread hand-off and a loop wake-up per call, and a thread per job
    in flight wakes as many threads (and as many GIL hand-offs) as there are jobs. Here jobs
    wait in one queue; a thread that finishes a job takes the next without sleeping, and
    finished jobs reach the loop in batches. Another thread is woken (or started) only when
    nobody is awake to take a job, or when every awake thread has been on its job for
    BLOCKED_S (it blocks: sleeps, waits for I/O), as many again as are awake; the loop checks
    that again every BLOCKED_S while jobs wait that no awake thread is free to take (and not
    at all otherwise: an idle pool, or one with a thread for every job, arms no timer). At most `slots` jobs (max_concurrent_steps) run at once; the rest wait in
    the queue, so a burst of steps is handed over together, not in waves. A job given up on
    (`forget`: its step ran past its timeout, or was cancelled) frees its slot at once, though
    its thread runs on until the action returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[Job] = deque()
        #: Sleeping threads, each waiting on its own lock (released to wake it).
        self._sleepers: list[threading.Lock] = []
        self._threads = 0
        #: Threads not sleeping: running a job, or about to take one.
        self._awake = 0
        #: Jobs holding a slot, and how many may.
        self._running = 0
        self._slots: float = math.inf
        #: When each awake thread's current job began (time.monotonic()), by thread.
        self._began: dict[int, float] = {}
        self._closed = False
        self._checking: set[asyncio.AbstractEventLoop] = set()
        self._completions: dict[asyncio.AbstractEventLoop, _Completions] = {}

    @property
    def threads(self) -> int:
        """Return how many worker threads exist."""
        return self._threads

    def submit(self, fn: Callable[[], Any], slots: float | None = None) -> Job:
        """Queue `fn` to run in a worker thread, in a copy of this context; await `job.future`.

        `slots` caps the jobs that run at once (from now on, for every job). A caller that
        stops waiting must `forget` the job.
        """
        loop = asyncio.get_running_loop()
        done = self._completions.get(loop)
        if done is None:
            for closed in [lp for lp in self._completions if lp.is_closed()]:
                self._completions.pop(closed).close()
            done = self._completions[loop] = _Completions(loop)
        job = Job(fn, contextvars.copy_context(), loop.create_future(), done)
        with self._lock:
            if slots is not None:
                self._slots = max(1, slots)
            self._closed = False
            self._jobs.append(job)
            self._grow()
            waiting = self._stuck()
        if waiting and loop not in self._checking:
            self._checking.add(loop)
            loop.call_later(BLOCKED_S, self._check, loop)
        return job

    def forget(self, job: Job) -> None:
        """Stop waiting for a job: one not started never runs; a running one frees its slot."""
        job.future.cancel()
        with self._lock:
            job.gone = True
            if job.holding:
                job.holding = False
                self._running -= 1
                self._grow()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` in a worker thread and return what it returns (see `submit`).

        Cancelling the caller stops waiting for it; the thread runs `fn` to its end.
        """
        job = self.submit(fn)
        try:
            result: T = await job.future
        except BaseException:
            self.forget(job)
            raise
        return result

    def close(self) -> None:
        """Let every idle thread end; busy ones end after their job."""
        with self._lock:
            self._closed = True
            sleepers, self._sleepers = self._sleepers, []
            self._awake += len(sleepers)
        for wake in sleepers:
            wake.release()

    def _grow(self) -> None:
        """Wake (or start) threads for the queued jobs nobody will take soon; holds the lock."""
        free = int(min(len(self._jobs), self._slots - self._running))
        if free <= 0:
            return
        now = time.monotonic()
        if self._awake == 0:
            wanted = 1
        elif len(self._began) == self._awake and all(
            now - began >= BLOCKED_S for began in self._began.values()
        ):
            # Doubling: steps that block get their threads within a few checks, and a thread
            # that was only slow to get the GIL wakes one more, not every free slot's.
            wanted = self._awake
        else:
            return
        for _ in range(min(wanted, free)):
            self._awake += 1
            if self._sleepers:
                self._sleepers.pop().release()
            else:
                self._threads += 1
                wake = threading.Lock()
                wake.acquire()
                threading.Thread(
                    target=self._work, args=(wake,), name="workflowd-step", daemon=True
                ).start()

    def _stuck(self) -> bool:
        """Tell whether jobs wait that no awake thread is free to take; holds the lock.

        Only then is a check due: a job a thread was just woken for needs none, so a lone
        step (a timer's, a callback's) costs no loop timer.
        """
        return len(self._jobs) > self._awake - len(self._began)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._grow()
            waiting = self._stuck()
        if waiting and not loop.is_closed():
            loop.call_later(BLOCKED_S, self._check, loop)
        else:
            self._checking.discard(loop)

    def _take(self, me: int, finished: Job | None, wake: threading.Lock) -> Job | bool:
        """Free the finished job's slot and take the next job; else sleep on `wake` (True) or end."""
        with self._lock:
            if finished is not None and finished.holding:
                finished.holding = False
                self._running -= 1
            while self._jobs and self._running < self._slots:
                job = self._jobs.popleft()
                if job.gone:
                    continue
                job.holding = True
                self._running += 1
                self._began[me] = time.monotonic()
                return job
            self._began.pop(me, None)
            self._awake -= 1
            if self._closed:
                return False
            self._sleepers.append(wake)
            return True

    def _work(self, wake: threading.Lock) -> None:
        name_os_thread("wd-step")
        me = threading.get_ident()
        job: Job | None = None
        # A finished job's result is posted once the next job is taken (or the thread is
        # asleep): the loop, woken by it, then never counts this thread as still busy.
        result: tuple[Job, bool, Any] | None = None
        try:
            while True:
                taken = self._take(me, job, wake)
                if result is not None:
                    done, ok, value = result
                    result = None
                    done.done.put(done.future, ok, value)
                    del done, value  # drop the references before blocking for the next one
                if taken is False:
                    return
                if taken is True:
                    job = None
                    wake.acquire()  # until a submit (or close) releases it
                    continue
                job = taken
                try:
                    result = (job, True, job.context.run(job.fn))
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting step
                    result = (job, False, e)
        finally:
            with self._lock:
                self._threads -= 1
