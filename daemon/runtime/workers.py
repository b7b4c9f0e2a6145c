"""Worker threads for sync steps: long-lived, fed from one queue, waking the loop once a batch."""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


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
    """A pool of threads that run sync step actions, grown when every thread is busy.

    anyio.to_thread costs a thread hand-off and a loop wake-up per call; here a thread that
    finishes a job takes the next one without sleeping, and finished jobs reach the loop in
    batches. How many run at once is the caller's limiter's business (max_concurrent_steps);
    a thread running an abandoned step stays busy until its action returns, and new jobs get
    new threads meanwhile.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job, each one reserved by a queued job
        self._threads = 0
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
            spawn = self._idle == 0
            if spawn:
                self._threads += 1
            else:
                self._idle -= 1
        if spawn:
            threading.Thread(
                target=self._work, args=(job,), name="workflowd-step", daemon=True
            ).start()
        else:
            self._jobs.put(job)
        result: T = await job.future
        return result

    def close(self) -> None:
        """Let every idle thread end; busy ones end after their job."""
        with self._lock:
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)

    def _work(self, job: _Job | None) -> None:
        try:
            while job is not None:
                try:
                    value, ok = job.context.run(job.fn), True
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting step
                    value, ok = e, False
                # Idle before the result is out: the step it wakes may queue the next job at once.
                with self._lock:
                    self._idle += 1
                job.done.put(job.future, ok, value)
                job = value = None  # drop references before blocking for the next one
                job = self._jobs.get()
        finally:
            with self._lock:
                self._threads -= 1
