"""The log's writer thread: records queued on the event loop, rendered and written in batches."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog
from structlog.typing import EventDict

from daemon.observe.threads import name_os_thread

#: One queued record: the method, the event dict (bound context, keywords and event), the
#: caller's context (its contextvars are merged off the loop) and the Unix time of the call.
Record = tuple[str, EventDict, contextvars.Context, float]


class Batcher:
    """Hands records from the event loop to one writer thread, which renders and writes batches.

    Rendering and writing cost the loop nothing: it only queues the record, and the first
    record of a loop turn schedules one kick (call_soon) that wakes the writer at the end of
    that turn, only if it sleeps: a writer still busy takes the new records when it is done.
    No timer is armed, so neither the loop nor the writer wakes when there is nothing to
    write. A woken writer lingers LINGER_S before it takes the queue, so the records of the
    turns that follow ride along: one wake-up and one write per few requests, not per turn.
    Records from outside a loop (worker threads, start-up, tests) and error records are
    written at once, after whatever is still queued, so nothing is reordered.
    """

    def __init__(self, emit: Callable[[list[Record]], None]) -> None:
        self._emit = emit
        self._queue: deque[Record] = deque()
        self._lock = threading.Lock()  # one writer at a time, in queue order
        # The idle thread blocks acquiring the bell; the kick that finds it idle (under
        # `_flag`) releases it: two C calls for the waker, where a Condition's notify and
        # wait cost a dozen Python calls and a new lock per wait.
        self._flag = threading.Lock()
        self._bell = threading.Lock()
        self._bell.acquire()
        self._idle = False  # the thread waits on the bell: only then does a kick ring it
        self._kick_loop: asyncio.AbstractEventLoop | None = None  # the loop a kick is due on
        self._kick_thread = 0  # that loop's thread
        self._closed = False
        self.wakes = 0  #: times the writer thread was woken (the benchmarks print it)
        self._thread = threading.Thread(target=self._run, name="workflowd-log", daemon=True)
        self._thread.start()

    def put(self, record: Record) -> None:
        """Queue one record; the writer takes it once this loop turn ends."""
        self._queue.append(record)
        # The cheap test first (asyncio's _get_running_loop calls getpid each time): this
        # thread runs the loop a kick is already due on, so the record just waits for it.
        if self._kick_thread == _thread_id() and (loop := self._kick_loop) and loop.is_running():
            if len(self._queue) >= BATCH:
                self._notify()
            return
        loop = _running_loop()
        if loop is None or self._closed:
            self.flush()
        elif loop is not self._kick_loop:  # none due, or due on a loop that has stopped
            with self._flag:
                busy = not self._idle
            if busy:
                # Awake (lingering or writing): it looks at the queue under `_flag` before it
                # sleeps, so it takes this record; a kick would find it awake and do nothing,
                # at the cost of a loop callback (and often a loop turn) per record.
                return
            self._kick_loop, self._kick_thread = loop, _thread_id()
            loop.call_soon(self._kick)

    def put_now(self, record: Record) -> None:
        """Write one record at once, after everything queued before it."""
        self._queue.append(record)
        self.flush()

    def _kick(self) -> None:
        self._kick_loop, self._kick_thread = None, 0
        self._notify()

    def _notify(self) -> None:
        """Wake the writer if it sleeps; a busy one looks at the queue again before sleeping."""
        with self._flag:
            if self._idle:
                self._idle = False
                self.wakes += 1
                self._bell.release()

    def flush(self) -> None:
        """Write everything queued so far, on the calling thread."""
        with self._lock:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), BATCH))]
                self._emit(batch)

    def close(self) -> None:
        """Write what is queued and stop the writer; later records are written at once."""
        self._kick_loop, self._kick_thread = None, 0  # no record may wait for a kick any more
        with self._flag:
            self._closed = True
            if self._idle:
                self._idle = False
                self._bell.release()
        self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        name_os_thread("wd-log")
        flag, bell = self._flag, self._bell
        while True:
            # The queue is checked under the lock a kick takes: a record queued before its
            # kick is either seen here or its kick finds the thread idle and rings.
            with flag:
                sleep = not self._queue and not self._closed
                self._idle = sleep
            if sleep:
                bell.acquire()
                if not self._closed:
                    _sleep(LINGER_S)  # gives up the GIL meanwhile
            if self._closed:
                return  # close() flushes what is left on its own thread
            try:
                self.flush()
            except Exception:  # a broken stream must not kill the writer; the next batch retries
                logging.getLogger(__name__).debug("log_write_failed", exc_info=True)


#: Records rendered and written together at most; a turn that queues this many wakes the
#: writer before the turn ends.
BATCH = 512
#: How long a woken writer waits for more records before it writes (error records never
#: wait: they are written at once, after these).
LINGER_S = 0.005
_sleep = time.sleep


#: The event loop running on this thread, or None; no exception to catch, unlike
#: asyncio.get_running_loop.
_running_loop = asyncio._get_running_loop
_thread_id = threading.get_ident


class Queued:
    """The logger structlog calls last: its every method queues one record."""

    def __init__(self, batcher: Batcher) -> None:
        self.msg = self.debug = self.info = self.warning = self.warn = batcher.put
        # Errors are written at once: they are what an operator reads after a crash.
        self.error = self.critical = self.exception = self.fatal = batcher.put_now

    def __call__(self, *args: Any) -> Queued:
        """Act as its own logger factory."""
        return self


def merge_context(event_dict: EventDict, context: contextvars.Context) -> None:
    """Add the caller's bound contextvars, as merge_contextvars would have on its thread.

    Each variable's key (None for another library's) is worked out once, not per record.
    """
    for var, value in context.items():
        key = _key_get(var)
        if key is None:
            if var in _keys:
                continue
            key = _key_of(var)
            if key is None:
                continue
        if value is not Ellipsis:  # Ellipsis: unbound
            event_dict.setdefault(key, value)


def _key_of(var: contextvars.ContextVar[Any]) -> str | None:
    """Remember and return the log key a contextvar binds, or None if it is not structlog's."""
    if len(_keys) >= _KEYS_MAX:  # variables made on the fly: the cache must not grow for ever
        _keys.clear()
    name = var.name
    key = name[_PREFIX_LEN:] if name[:_PREFIX_LEN] == _PREFIX else None
    _keys[var] = key
    return key


_PREFIX = structlog.contextvars.STRUCTLOG_KEY_PREFIX
_PREFIX_LEN = len(_PREFIX)
_KEYS_MAX = 4096
_keys: dict[contextvars.ContextVar[Any], str | None] = {}
_key_get = _keys.get

#: The last second iso_time rendered, as (Unix second, "YYYY-MM-DDTHH:MM:SS.").
_second: list[tuple[float, str]] = [(-1.0, "")]


def iso_time(stamp: float) -> str:
    """Render a Unix time as ISO 8601 UTC, exactly as TimeStamper(fmt="iso", utc=True) does.

    The microseconds are rounded as datetime.fromtimestamp rounds them (half to even, carried
    into the second); the date and time of day are formatted once per second, not per record,
    and the six digits are cut from 1_000_000 + micros (a format spec costs three times that).
    """
    fraction, whole = math.modf(stamp)
    micros = round(fraction * 1e6)
    if micros >= 1_000_000:
        micros, whole = micros - 1_000_000, whole + 1.0
    elif micros < 0:
        micros, whole = micros + 1_000_000, whole - 1.0
    second, text = _second[0]
    if second != whole:
        text = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(whole))
        _second[0] = (whole, text)
    if micros:
        return text + str(1_000_000 + micros)[1:] + "Z"
    return text[:-1] + "Z"  # isoformat drops a zero fraction


def stamped(batch: list[Record], levels: dict[str, str]) -> list[EventDict]:
    """Return the batch's event dicts with their context merged, time and level added.

    What merge_context and iso_time do for one record, for a whole batch in one frame: two
    calls less per record on a thread that holds the GIL the loop wants. `levels` names the
    level of the methods that are not levels themselves.
    """
    dicts: list[EventDict] = []
    append = dicts.append
    get_level = levels.get
    second, text = _second[0]
    for method, event_dict, context, stamp in batch:
        for var, value in context.items():
            key = _key_get(var)
            if key is None:
                if var in _keys:
                    continue
                key = _key_of(var)
                if key is None:
                    continue
            if value is not Ellipsis:  # Ellipsis: unbound
                event_dict.setdefault(key, value)
        fraction, whole = _modf(stamp)
        micros = round(fraction * 1e6)
        if micros >= 1_000_000:
            micros, whole = micros - 1_000_000, whole + 1.0
        elif micros < 0:
            micros, whole = micros + 1_000_000, whole - 1.0
        if second != whole:
            second, text = whole, time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(whole))
            _second[0] = (second, text)
        event_dict["timestamp"] = (
            text + str(1_000_000 + micros)[1:] + "Z" if micros else text[:-1] + "Z"
        )
        event_dict["level"] = get_level(method, method)
        append(event_dict)
    return dicts


_modf = math.modf
