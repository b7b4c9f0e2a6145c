"""Worker threads for sync steps: long-lived, fed from one queue, waking the loop once a batch."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
#: How long a job must have run before its thread counts as blocked, and another is woken for
#: the jobs queued behind it: twice the interpreter's GIL switch interval (5 ms), so that a
#: thread that only waits for the GIL behind a busy loop does not count.
BLOCKED_S = 0.01


@dataclass(slots=True, eq=False)
class _Job:
    fn: Callable[[], Any]
    context: contextvars.Context
    future: asyncio.Future[Any]
    done: _Completions


class _Completions:
    """Finished jobs of one event loop, handed back to it with one wake-up per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._finished: deque[tuple[asyncio.Future[Any], bool, Any]] = deque()
        self._wake_pending = False

    def put(self, future: asyncio.Future[Any], ok: bool, value: Any) -> None:
        """Queue a result (from a worker thread); wake the loop unless a wake-up is on its way."""
        self._finished.append((future, ok, value))
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: nobody awaits these any more
                self._finished.clear()

    def _deliver(self) -> None:
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
    BLOCKED_S (it blocks: sleeps, waits for I/O); the loop checks that again every BLOCKED_S
    while jobs wait. How many run at once is the caller's limiter's business
    (max_concurrent_steps); a thread running an abandoned step is one that blocks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        #: Sleeping threads, each waiting on its own lock (released to wake it).
        self._sleepers: list[threading.Lock] = []
        self._threads = 0
        #: Threads not sleeping: running a job, or about to take one.
        self._awake = 0
        #: When each awake thread's current job began (time.monotonic()), by thread.
        self._began: dict[int, float] = {}
        self._closed = False
        self._checking: set[asyncio.AbstractEventLoop] = set()
        self._completions: dict[asyncio.AbstractEventLoop, _Completions] = {}

    @property
    def threads(self) -> int:
        """Return how many worker threads exist."""
        return self._threads

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` in a worker thread, in a copy of this context, and return what it returns.

        Cancelling the caller stops waiting for it; the thread runs `fn` to its end.
        """
        loop = asyncio.get_running_loop()
        done = self._completions.get(loop)
        if done is None:
            self._completions = {lp: c for lp, c in self._completions.items() if not lp.is_closed()}
            done = self._completions[loop] = _Completions(loop)
        job = _Job(fn, contextvars.copy_context(), loop.create_future(), done)
        with self._lock:
            self._closed = False
            self._jobs.append(job)
            self._grow()
            waiting = bool(self._jobs) and self._awake > 0
        if waiting and loop not in self._checking:
            self._checking.add(loop)
            loop.call_later(BLOCKED_S, self._check, loop)
        result: T = await job.future
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
        now = time.monotonic()
        if self._awake == 0:
            wanted = 1
        elif len(self._began) == self._awake and all(
            now - began >= BLOCKED_S for began in self._began.values()
        ):
            wanted = len(self._jobs)
        else:
            return
        for _ in range(min(wanted, len(self._jobs))):
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

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._grow()
            waiting = bool(self._jobs)
        if waiting and not loop.is_closed():
            loop.call_later(BLOCKED_S, self._check, loop)
        else:
            self._checking.discard(loop)

    def _work(self, wake: threading.Lock) -> None:
        me = threading.get_ident()
        try:
            while True:
                with self._lock:
                    if not self._jobs:
                        self._began.pop(me, None)
                        if self._closed:
                            self._awake -= 1
                            return
                        self._awake -= 1
                        self._sleepers.append(wake)
                        job = None
                    else:
                        job = self._jobs.popleft()
                        self._began[me] = time.monotonic()
                if job is None:
                    wake.acquire()  # until a submit (or close) releases it
                    continue
                try:
                    value, ok = job.context.run(job.fn), True
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting step
                    value, ok = e, False
                job.done.put(job.future, ok, value)
                job = value = None  # drop references before blocking for the next one
        finally:
            with self._lock:
                self._threads -= 1
