"""structlog setup: JSON lines on stdout, stdlib logs routed through it, and a live fan-out."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TextIO

import msgspec
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from daemon.service.journal import JournalLogger, JournalRenderer

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_level = [LEVELS["info"]]  # mutable so set_level reaches loggers that are already cached
_handler: list[logging.Handler] = []


#: Types JSON holds as they are (exactly these: subclasses such as enums go through _jsonable).
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _jsonable(value: Any) -> Any:
    """Return `value` with everything JSON cannot hold turned into str."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


_encoder = msgspec.json.Encoder(enc_hook=str)


def _render_json(_: WrappedLogger, __: str, event_dict: EventDict) -> str:
    """Render the event as one JSON line (what JSONRenderer does, one call less)."""
    return _encoder.encode(event_dict).decode()


class _Subscription:
    """One live reader: a bounded queue filled from any thread, drained on its event loop."""

    def __init__(self, workflow_id: str | None, limit: int, backlog: list[dict[str, Any]]) -> None:
        self.workflow_id = workflow_id
        self.limit = limit
        self.queue = deque(r for r in backlog if self.wants(r))
        self.dropped = 0  # total, for callers that report it
        self._gap = 0  # dropped since the reader last caught up
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._wakeup = asyncio.Event()
        self._wake_pending = False  # a wake-up from another thread is on its way

    def wants(self, record: dict[str, Any]) -> bool:
        return self.workflow_id is None or record.get("workflow_id") == self.workflow_id

    def offer(self, record: dict[str, Any]) -> None:
        """Queue `record` or count it as dropped; never blocks."""
        if len(self.queue) >= self.limit:
            self.dropped += 1
            self._gap += 1
            return
        self.queue.append(record)
        if threading.get_ident() == self._thread:
            self._wakeup.set()
            return
        # Records come from the log writer's thread (and aiosqlite's); one wake-up per batch,
        # not one per record. anyio's from_thread would block the sender.
        if not self._wake_pending:
            self._wake_pending = True
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading any more
                self._loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        self._wake_pending = False
        self._wakeup.set()

    async def records(self) -> AsyncGenerator[dict[str, Any], None]:
        while True:
            while self.queue:
                yield self.queue.popleft()
            if self._gap:
                gap, self._gap = self._gap, 0
                yield {"event": "log_records_dropped", "level": "warning", "count": gap}
                continue
            self._wakeup.clear()
            if not self.queue:
                await self._wakeup.wait()


class LogHub:
    """Keeps the last `size` log records and streams new ones to subscribers."""

    def __init__(self, size: int = 1000, subscriber_limit: int = 1000) -> None:
        self._buffer: deque[dict[str, Any]] = deque(maxlen=size)
        self._subs: set[_Subscription] = set()
        self._lock = threading.Lock()
        self._limit = subscriber_limit

    def publish(self, record: dict[str, Any]) -> None:
        """Store `record` and hand it to every subscriber that wants it."""
        with self._lock:
            self._buffer.append(record)
            for sub in self._subs:
                if sub.wants(record):
                    sub.offer(record)

    def recent(self, workflow_id: str | None = None) -> list[dict[str, Any]]:
        """Return the buffered records (of one workflow if given), oldest first."""
        flush_logs()  # records still queued for the writer were logged before this call
        with self._lock:
            records = list(self._buffer)
        return [r for r in records if workflow_id is None or r.get("workflow_id") == workflow_id]

    @asynccontextmanager
    async def subscribe(
        self, workflow_id: str | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Yield an iterator over the buffered records, then live ones (of one workflow if given)."""
        flush_logs()
        with self._lock:
            sub = _Subscription(workflow_id, self._limit, list(self._buffer))
            self._subs.add(sub)
        records = sub.records()
        try:
            yield records
        finally:
            with self._lock:
                self._subs.discard(sub)
            await records.aclose()

    def processor(self, _: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        """Publish a JSON-able copy of the event; goes right before the renderer."""
        record = dict(event_dict)
        for key in event_dict:
            if key[:1] == "_":  # structlog's meta keys are not part of the record
                del record[key]
        if "exc_info" in record:  # console mode: the renderer, not dict_tracebacks, shows it
            record = dict(structlog.processors.format_exc_info(None, method, record))
        # Nearly every event holds only plain values: then this shallow copy will do.
        plain = _PLAIN.issuperset(map(type, record.values()))
        self.publish(record if plain else _jsonable(record))
        return event_dict


#: One queued record: the method, the event dict (bound context, keywords and event), the
#: caller's context (its contextvars are merged off the loop) and the Unix time of the call.
_Record = tuple[str, EventDict, contextvars.Context, float]


class _Batcher:
    """Hands records from the event loop to one writer thread, which renders and writes batches.

    Rendering and writing cost the loop nothing: it only queues the record and wakes the writer
    once a batch has lingered _LINGER_S (or filled up). Records from outside a loop (worker
    threads, start-up, tests) and error records are written at once, after whatever is still
    queued, so nothing is reordered.
    """

    def __init__(self, emit: Callable[[list[_Record]], None]) -> None:
        self._emit = emit
        self._queue: deque[_Record] = deque()
        self._lock = threading.Lock()  # one writer at a time, in queue order
        self._wake = threading.Event()
        self._kick_loop: asyncio.AbstractEventLoop | None = None  # the loop a kick is due on
        self._kick_thread = 0  # that loop's thread
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="workflowd-log", daemon=True)
        self._thread.start()

    def put(self, record: _Record) -> None:
        """Queue one record; the writer takes it within _LINGER_S."""
        self._queue.append(record)
        # The cheap test first (asyncio's _get_running_loop calls getpid each time): this
        # thread runs the loop a kick is already due on, so the record just waits for it.
        if self._kick_thread == _thread_id() and (loop := self._kick_loop) and loop.is_running():
            if len(self._queue) >= _BATCH and not self._wake.is_set():
                self._wake.set()
            return
        loop = _running_loop()
        if loop is None or self._closed:
            self.flush()
        elif loop is not self._kick_loop:  # none due, or due on a loop that has stopped
            self._kick_loop, self._kick_thread = loop, _thread_id()
            loop.call_later(_LINGER_S, self._kick)

    def put_now(self, record: _Record) -> None:
        """Write one record at once, after everything queued before it."""
        self._queue.append(record)
        self.flush()

    def _kick(self) -> None:
        self._kick_loop, self._kick_thread = None, 0
        self._wake.set()

    def flush(self) -> None:
        """Write everything queued so far, on the calling thread."""
        with self._lock:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), _BATCH))]
                self._emit(batch)

    def close(self) -> None:
        """Write what is queued and stop the writer; later records are written at once."""
        self._closed = True
        self._kick_loop, self._kick_thread = None, 0  # no record may wait for a kick any more
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # a broken stream must not kill the writer; the next batch retries
                logging.getLogger(__name__).debug("log_write_failed", exc_info=True)


#: Records rendered and written together at most; also wakes the writer early.
_BATCH = 512
#: How long the first record of a batch waits for others before the writer wakes: a workflow
#: running steps one by one takes a loop turn per step, and a wake-up (and a write) per turn
#: would cost more than the record itself.
_LINGER_S = 0.002


#: The event loop running on this thread, or None; no exception to catch, unlike
#: asyncio.get_running_loop.
_running_loop = asyncio._get_running_loop
_thread_id = threading.get_ident


class _Queued:
    """The logger structlog calls last: its every method queues one record."""

    def __init__(self, batcher: _Batcher) -> None:
        self.msg = self.debug = self.info = self.warning = self.warn = batcher.put
        # Errors are written at once: they are what an operator reads after a crash.
        self.error = self.critical = self.exception = self.fatal = batcher.put_now

    def __call__(self, *args: Any) -> _Queued:
        """Act as its own logger factory."""
        return self


def _hand_over(_: WrappedLogger, method: str, event_dict: EventDict) -> Any:
    """End a reconfigured loop-side chain: pass the event dict on to _Queued as one record."""
    if event_dict.get("exc_info") is True:  # must be taken now, on the thread that caught it
        event_dict["exc_info"] = sys.exc_info()
    return ((method, event_dict, contextvars.copy_context(), time.time()),), {}


#: The loop-side chain configure_logging sets. A logger holding exactly this list skips
#: structlog's processor loop (_Leveled._queue does _hand_over's work inline); one handed
#: another chain (a test's spy in front) runs it the ordinary way.
_LOOP_CHAIN: list[Processor] = [_hand_over]


def _merge_context(event_dict: EventDict, context: contextvars.Context) -> None:
    """Add the caller's bound contextvars, as merge_contextvars would have on its thread."""
    for var, value in context.items():
        name = var.name
        if name[:_PREFIX_LEN] == _PREFIX and value is not Ellipsis:  # Ellipsis: unbound
            event_dict.setdefault(name[_PREFIX_LEN:], value)


_PREFIX = structlog.contextvars.STRUCTLOG_KEY_PREFIX
_PREFIX_LEN = len(_PREFIX)

#: The last second _iso_time rendered, as (Unix second, "YYYY-MM-DDTHH:MM:SS").
_second: list[tuple[float, str]] = [(-1.0, "")]


def _iso_time(stamp: float) -> str:
    """Render a Unix time as ISO 8601 UTC, exactly as TimeStamper(fmt="iso", utc=True) does.

    The microseconds are rounded as datetime.fromtimestamp rounds them (half to even, carried
    into the second); the date and time of day are formatted once per second, not per record.
    """
    fraction, whole = math.modf(stamp)
    micros = round(fraction * 1e6)
    if micros >= 1_000_000:
        micros, whole = micros - 1_000_000, whole + 1.0
    elif micros < 0:
        micros, whole = micros + 1_000_000, whole - 1.0
    second, text = _second[0]
    if second != whole:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _second[0] = (whole, text)
    return f"{text}.{micros:06d}Z" if micros else f"{text}Z"  # isoformat drops a zero fraction


class _Leveled(structlog.BoundLoggerBase):
    """A bound logger that drops records under the current level and queues the rest.

    On the loop a record costs a level check, the event dict structlog would build anyway, a
    reference to the caller's context (copy_context is O(1)) and the time: merging the
    contextvars, the timestamp's text, rendering and writing happen in the writer thread.
    """

    def _queue(self, method: str, event: str | None, kw: dict[str, Any]) -> None:
        if self._processors is not _LOOP_CHAIN:
            self._proxy_to_logger(method, event, **kw)
            return
        context = self._context
        event_dict = {**context, **kw} if context else kw  # kw is this call's own dict
        if event is not None:
            event_dict["event"] = event
        if "exc_info" in event_dict and event_dict["exc_info"] is True:
            event_dict["exc_info"] = sys.exc_info()
        getattr(self._logger, method)((method, event_dict, _snapshot(), _now()))

    def debug(self, event: str | None = None, **kw: Any) -> None:
        if _level[0] <= 10:
            self._queue("debug", event, kw)

    def info(self, event: str | None = None, **kw: Any) -> None:
        if _level[0] <= 20:
            self._queue("info", event, kw)

    def warning(self, event: str | None = None, **kw: Any) -> None:
        if _level[0] <= 30:
            self._queue("warning", event, kw)

    warn = warning

    def error(self, event: str | None = None, **kw: Any) -> None:
        if _level[0] <= 40:
            self._queue("error", event, kw)

    def exception(self, event: str | None = None, **kw: Any) -> None:
        kw.setdefault("exc_info", True)
        if _level[0] <= 40:
            self._queue("error", event, kw)

    def critical(self, event: str | None = None, **kw: Any) -> None:
        self._queue("critical", event, kw)

    fatal = critical

    def log(self, level: int, event: str | None = None, **kw: Any) -> None:
        if level >= _level[0]:
            self._queue(logging.getLevelName(level).lower(), event, kw)


_snapshot = contextvars.copy_context
_now = time.time


_batcher: list[_Batcher] = []
_atexit_registered: list[object] = []


def flush_logs() -> None:
    """Write every queued record now (before os._exit, which skips atexit)."""
    for batcher in _batcher:
        batcher.flush()


def close_logging() -> None:
    """Write every queued record and stop the writer thread; later records are written at once."""
    for batcher in _batcher:
        batcher.close()
    _batcher.clear()


def configure_logging(
    level: str = "info",
    fmt: str = "auto",
    stream: TextIO | None = None,
    cache: bool = True,
    hub: LogHub | None = None,
    journal: str | None = None,
) -> None:
    """Configure structlog and the stdlib root logger to write one line per event to `stream`.

    With `journal` (journald's socket), our own records go there instead, each line with
    native fields (WORKFLOW_ID=, STEP=...); `stream` then only gets what cannot be sent.
    """
    out = stream if stream is not None else sys.stdout
    # Under systemd, $JOURNAL_STREAM is set and stdout is no TTY: JSON lines go to journald as is.
    as_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    renderer: Processor = (
        _render_json if as_json else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    tail: list[Processor] = [structlog.processors.dict_tracebacks] if as_json else []
    tail += [hub.processor] if hub is not None else []
    sink = JournalLogger(out, journal) if journal is not None else None
    last: Processor = renderer if sink is None else JournalRenderer(renderer)
    back = [structlog.processors.add_log_level, *tail, last]

    def emit(batch: list[_Record]) -> None:
        lines: list[str] = []
        for method, event_dict, context, stamp in batch:
            _merge_context(event_dict, context)
            event_dict["timestamp"] = _iso_time(stamp)
            rendered: Any = event_dict
            try:
                for proc in back:
                    rendered = proc(None, method, rendered)
            except structlog.DropEvent:
                continue
            if sink is None:
                lines.append(rendered)
            else:
                (line,), kw = rendered
                sink.msg(line, **kw)
        if lines:
            out.write("\n".join(lines) + "\n")
            out.flush()

    close_logging()
    batcher = _Batcher(emit)
    _batcher[:] = [batcher]
    if not _atexit_registered:
        _atexit_registered.append(atexit.register(close_logging))
    structlog.configure(
        # The loop-side chain stays short: the context and the time are taken now, the rest later.
        processors=_LOOP_CHAIN,
        wrapper_class=_Leveled,
        logger_factory=_Queued(batcher),
        cache_logger_on_first_use=cache,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *tail,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for old_handler in _handler:
        root.removeHandler(old_handler)
    _handler[:] = [handler]
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    """Change the minimum level of every logger, including already-cached ones."""
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}")
    _level[0] = LEVELS[level]
    logging.getLogger().setLevel(LEVELS[level])
    # aiosqlite logs every statement at debug; that drowns the daemon's own debug output.
    logging.getLogger("aiosqlite").setLevel(max(LEVELS[level], logging.INFO))
