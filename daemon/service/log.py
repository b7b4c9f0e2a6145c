"""structlog setup: JSON lines on stdout, stdlib logs routed through it, and a live fan-out."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
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

from daemon.service.journal import JournalLogger, JournalRenderer, journal_fields
from daemon.service.logwriter import (
    Batcher,
    Queued,
    Record,
    iso_time,
    merge_context,
    stamped,
)

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
        return {_text(k): _jsonable(v) for k, v in value.items()}
    return _text(value)


def _text(value: Any) -> str:
    """Return str(value), or a placeholder naming its type if its __str__ raises."""
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - a broken __str__ must not cost the record
        return f"<{type(value).__qualname__}: str() failed>"


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
                yield _hub_record(self.queue.popleft())
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
        return [
            _hub_record(r)
            for r in records
            if workflow_id is None or r.get("workflow_id") == workflow_id
        ]

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

    def publish_many(self, records: list[dict[str, Any]]) -> None:
        """Store rendered event dicts and hand each to every subscriber that wants it, at once.

        They are stored as they are: nobody changes an event dict once it is rendered, and
        the few records that need it are made JSON-able when read (_hub_record), which costs
        the log's writer thread nothing for records that nobody reads.
        """
        with self._lock:
            self._buffer.extend(records)
            for sub in self._subs:
                for record in records:
                    if sub.wants(record):
                        sub.offer(record)

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


#: add_log_level's names for the methods that are not levels themselves.
_METHOD_LEVEL = {"warn": "warning", "exception": "error"}
_tracebacks = structlog.processors.dict_tracebacks


def _json_emitter(
    out: TextIO, hub: LogHub | None, sink: JournalLogger | None
) -> Callable[[list[Record]], None]:
    """Return an emit that does what the JSON chain does, for a whole batch at once.

    The chain is add_log_level, dict_tracebacks, the hub and the JSON renderer: here each
    record gets its context, timestamp, level and traceback in one loop, the hub takes the
    batch under one lock, and msgspec renders every line in one call. The lines are the same,
    byte for byte; a record msgspec cannot render is rendered alone, its odd values as text.
    """

    def emit(batch: list[Record]) -> None:
        dicts: list[Any] = stamped(batch, _METHOD_LEVEL)  # the event dicts _queue made
        for i, event_dict in enumerate(dicts):
            if "exc_info" in event_dict:  # it renders the traceback into this same dict
                _tracebacks(None, batch[i][0], event_dict)
        if hub is not None:
            hub.publish_many(dicts)
        if sink is not None:  # one datagram per record, each with its own fields
            for d in dicts:
                line = _encode_line(d)
                if line:
                    sink.send(line, journal_fields(d))
            return
        try:
            text = _encoder.encode_lines(dicts)
        except Exception:  # noqa: BLE001 - one odd record must not cost the batch its lines
            text = b"".join(line + b"\n" for d in dicts if (line := _encode_line(d)))
        if text:
            out.write(text.decode())
            out.flush()

    return emit


def _encode_line(event_dict: EventDict) -> bytes:
    """Render one record (no newline), values msgspec refuses as text; b"" if even that fails."""
    with contextlib.suppress(Exception):
        return _encoder.encode(event_dict)
    try:  # again with every odd value as text (a placeholder where even str() fails)
        return _encoder.encode(_jsonable(event_dict))
    except Exception:  # noqa: BLE001 - nothing left to try: this one record is lost
        return b""


def _hub_record(record: dict[str, Any]) -> dict[str, Any]:
    """Return a stored record as readers get it: no meta keys ("_..."), JSON-able values.

    The usual record (plain values, no meta key) is returned as it is, not copied.
    """
    if any(k[:1] == "_" for k in record):
        record = {k: v for k, v in record.items() if k[:1] != "_"}
    return record if _PLAIN.issuperset(map(type, record.values())) else _jsonable(record)


def _hand_over(_: WrappedLogger, method: str, event_dict: EventDict) -> Any:
    """End a reconfigured loop-side chain: pass the event dict on to Queued as one record."""
    if event_dict.get("exc_info") is True:  # must be taken now, on the thread that caught it
        event_dict["exc_info"] = sys.exc_info()
    return ((method, event_dict, contextvars.copy_context(), time.time()),), {}


#: The loop-side chain configure_logging sets. A logger holding exactly this list skips
#: structlog's processor loop (_Leveled._queue does _hand_over's work inline); one handed
#: another chain (a test's spy in front) runs it the ordinary way.
_LOOP_CHAIN: list[Processor] = [_hand_over]


def _leveled(method: str, level: int) -> Callable[..., None]:
    """Return the logging method `method` of _Leveled, which drops records under `level`.

    It does _Leveled._queue's work inline: a record costs the loop one Python call here, and
    the one that queues it, instead of three.
    """

    def log_at(self: _Leveled, event: str | None = None, **kw: Any) -> None:
        if _level[0] > level:
            return
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

    log_at.__name__ = log_at.__qualname__ = method
    return log_at


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

    debug = _leveled("debug", 10)
    info = _leveled("info", 20)
    warning = warn = _leveled("warning", 30)
    error = _leveled("error", 40)

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


_batcher: list[Batcher] = []
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

    def chain(batch: list[Record]) -> None:
        lines: list[str] = []
        for method, event_dict, context, stamp in batch:
            merge_context(event_dict, context)
            event_dict["timestamp"] = iso_time(stamp)
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

    # What the daemon runs: the same JSON chain fused into one pass per batch.
    emit = _json_emitter(out, hub, sink) if as_json else chain
    close_logging()
    batcher = Batcher(emit)
    _batcher[:] = [batcher]
    if not _atexit_registered:
        _atexit_registered.append(atexit.register(close_logging))
    structlog.configure(
        # The loop-side chain stays short: the context and the time are taken now, the rest later.
        processors=_LOOP_CHAIN,
        wrapper_class=_Leveled,
        logger_factory=Queued(batcher),
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
