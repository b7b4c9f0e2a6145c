"""structlog setup: JSON lines on stdout, stdlib logs routed through it, and a live fan-out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TextIO

import msgspec
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from daemon.service.journal import JournalLogger, JournalRenderer

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
# Method names structlog passes to processors, mapped to their level.
_METHOD_LEVELS = {**LEVELS, "warn": 30, "exception": 40, "fatal": 50}
_level = [LEVELS["info"]]  # mutable so set_level reaches loggers that are already cached
_handler: list[logging.Handler] = []


def _drop_below_level(_: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """Drop events under the current level.

    make_filtering_bound_logger alone cannot do this: cached loggers keep the wrapper class they
    were first built with, so a SIGHUP could never lower the level of an existing logger.
    """
    if _METHOD_LEVELS.get(method, 20) < _level[0]:
        raise structlog.DropEvent
    return event_dict


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
        # Stdlib records may come from aiosqlite's thread; anyio's from_thread would block it.
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading any more
            self._loop.call_soon_threadsafe(self._wakeup.set)

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
        with self._lock:
            records = list(self._buffer)
        return [r for r in records if workflow_id is None or r.get("workflow_id") == workflow_id]

    @asynccontextmanager
    async def subscribe(
        self, workflow_id: str | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Yield an iterator over the buffered records, then live ones (of one workflow if given)."""
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
        record = {k: v for k, v in event_dict.items() if k[:1] != "_"}
        if "exc_info" in record:  # console mode: the renderer, not dict_tracebacks, shows it
            record = dict(structlog.processors.format_exc_info(None, method, record))
        # Nearly every event holds only plain values: then this shallow copy will do.
        plain = _PLAIN.issuperset(map(type, record.values()))
        self.publish(record if plain else _jsonable(record))
        return event_dict


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
    last: Processor = renderer if journal is None else JournalRenderer(renderer)
    structlog.configure(
        processors=[_drop_below_level, *shared, *tail, last],
        # Filtering happens in _drop_below_level, so the wrapper lets every level through.
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        logger_factory=(
            structlog.PrintLoggerFactory(out) if journal is None else JournalLogger(out, journal)
        ),
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
    for old in _handler:
        root.removeHandler(old)
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
