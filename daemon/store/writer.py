"""Group commit: one writer task commits every write queued at that moment in one transaction."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiosqlite
import anyio
import structlog

from daemon.errors import Unavailable
from daemon.observe.metrics import Metrics

T = TypeVar("T")
log = structlog.get_logger(__name__)
#: A write: runs on the writer's connection inside the batch's transaction.
Apply = Callable[[sqlite3.Connection], Any]


@dataclass(slots=True)
class StoreStats:
    """Counters that show group commit at work."""

    commits: int = 0  #: transactions committed
    writes: int = 0  #: write requests committed
    splits: int = 0  #: failed batches retried one request per transaction


@dataclass(slots=True, eq=False)
class _Write:
    apply: Apply
    #: A bare loop future, not an anyio.Event: this is made once per write and anyio looks its
    #: backend up on every Event it makes. A cancelled waiter cancels it, so check `done()`.
    done: asyncio.Future[None]
    result: Any = None
    error: BaseException | None = None

    def finish(self) -> None:
        """Wake the waiter, unless it was cancelled."""
        if not self.done.done():
            self.done.set_result(None)


def _transaction(conn: sqlite3.Connection, batch: list[_Write]) -> None:
    """Apply and commit `batch` in the transaction the caller began, or roll it all back."""
    try:
        results = [w.apply(conn) for w in batch]
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
    for w, result in zip(batch, results, strict=True):
        w.result = result


def _commit_batch(conn: sqlite3.Connection, batch: list[_Write]) -> tuple[int, bool]:
    """Commit `batch` in one transaction, or each write alone if that fails.

    Return the number of commits and whether the batch was split.
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
    except Exception as e:  # noqa: BLE001 - busy or broken: no request to blame, none retried
        for w in batch:
            w.error = e
        return 0, False
    try:
        _transaction(conn, batch)
        return 1, False
    except Exception as e:  # noqa: BLE001 - every caller gets its own error below
        if len(batch) == 1:
            batch[0].error = e
            return 0, False
    commits = 0
    for w in batch:
        try:
            conn.execute("BEGIN IMMEDIATE")
            _transaction(conn, [w])
            commits += 1
        except Exception as e:  # noqa: BLE001 - the caller re-raises it as is
            w.error = e
    return commits, True


async def _in_thread(conn: aiosqlite.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """Run `fn` on the connection's own thread.

    aiosqlite has no public call for this; its per-statement API costs a thread round trip
    per statement, while a whole batch needs only one.
    """
    raw = conn._conn
    result: T = await conn._execute(fn, raw)  # type: ignore[no-untyped-call]
    return result


class GroupWriter:
    """Owns the write connection; callers queue writes and each awaits its own commit."""

    def __init__(self, conn: aiosqlite.Connection, metrics: Metrics | None = None) -> None:
        self.stats = StoreStats()
        self._metrics = metrics
        self._conn = conn
        self._queue: deque[_Write] = deque()
        self._wake = asyncio.Event()  # set once per write: asyncio's is the cheaper one
        self._stopped = anyio.Event()
        self._closing = False

    @property
    def closed(self) -> bool:
        """Tell whether the writer has stopped for good."""
        return self._closing and self._stopped.is_set()

    async def close(self) -> None:
        """Commit what is queued, then stop."""
        self._closing = True
        self._wake.set()
        with anyio.CancelScope(shield=True):
            await self._stopped.wait()

    async def run(self) -> None:
        """Commit queued writes in groups until closed; fail what is left with Unavailable."""
        batch: builtins.list[_Write] = []
        try:
            while self._queue or not self._closing:
                if not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch = list(self._queue)
                self._queue.clear()
                began = time.perf_counter()
                commits, split = await _in_thread(
                    self._conn, functools.partial(_commit_batch, batch=batch)
                )
                if self._metrics is not None:
                    self._metrics.commit(time.perf_counter() - began, len(batch))
                failed = sum(w.error is not None for w in batch)
                self.stats.commits += commits
                self.stats.writes += len(batch) - failed
                if split:
                    self.stats.splits += 1
                    log.warning("store_batch_split", batch=len(batch), failed=failed)
                for w in batch:
                    w.finish()
                batch = []
        finally:
            self._closing = True
            for w in [*batch, *self._queue]:
                if not w.done.done():
                    w.error = Unavailable("the store closed before this write was committed")
                    w.finish()
            self._stopped.set()

    async def submit(self, apply: Apply) -> Any:
        """Queue one write and return its result once it is committed (or raise its error)."""
        if self._closing:
            raise Unavailable("the store is closed")
        w = _Write(apply, asyncio.get_running_loop().create_future())
        self._queue.append(w)
        self._wake.set()
        await w.done
        if w.error is not None:
            raise w.error
        return w.result
