"""Group commit on PostgreSQL: one task commits every write queued at that moment in one transaction."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from daemon.errors import Unavailable, WorkflowdError
from daemon.observe.metrics import Metrics
from daemon.store.writer import StoreStats

log = structlog.get_logger(__name__)
#: A connection of the pool, as the writer hands it to a write.
Conn: TypeAlias = "asyncpg.Connection[Any] | PoolConnectionProxy[Any]"
#: A write: runs on the writer's connection inside the batch's transaction.
Apply = Callable[[Conn], Awaitable[Any]]
#: Runs first in every transaction and raises if this daemon may no longer write.
Fence = Callable[[Conn], Awaitable[None]]


@dataclass(slots=True, eq=False)
class _Write:
    apply: Apply
    done: asyncio.Future[None]
    result: Any = None
    error: BaseException | None = None

    def finish(self) -> None:
        """Wake the waiter, unless it was cancelled."""
        if not self.done.done():
            self.done.set_result(None)


async def _transaction(conn: Conn, batch: builtins.list[_Write], fence: Fence | None) -> None:
    """Apply and commit `batch` in one transaction, or roll it all back and raise."""
    async with conn.transaction():
        if fence is not None:
            await fence(conn)
        results = [await w.apply(conn) for w in batch]
    for w, result in zip(batch, results, strict=True):
        w.result = result


def broken(e: Exception) -> bool:
    """Tell whether `e` leaves the connection unusable (rather than one statement refused)."""
    if isinstance(e, asyncpg.PostgresConnectionError | OSError):
        return True
    # Our own errors (WorkflowNotFound, a lost lease) and the server's refusals leave it fine.
    return not isinstance(e, asyncpg.PostgresError | WorkflowdError)


class PgGroupWriter:
    """Callers queue writes and each awaits its own commit; a failed batch is retried one by one."""

    def __init__(
        self, pool: asyncpg.Pool, *, fence: Fence | None = None, metrics: Metrics | None = None
    ) -> None:
        self.stats = StoreStats()
        self._metrics = metrics
        self._fence = fence
        self._pool = pool
        self._queue: deque[_Write] = deque()
        self._wake = asyncio.Event()
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

    async def _commit(self, batch: builtins.list[_Write]) -> tuple[int, bool]:
        """Commit `batch` in one transaction, or each write alone if that fails.

        A connection is taken from the pool per batch, so one the server dropped is replaced
        by the next batch instead of failing every write after it.
        """
        try:
            async with self._pool.acquire() as conn:
                try:
                    await _transaction(conn, batch, self._fence)
                    return 1, False
                except Exception as e:  # noqa: BLE001 - every caller gets its own error below
                    dead = broken(e)
                    if dead:
                        conn.terminate()  # the pool opens a fresh one for the next batch
                    if len(batch) == 1 or dead or conn.is_closed():
                        for w in batch:
                            w.error = e
                        return 0, False
                commits = 0
                for w in batch:
                    try:
                        await _transaction(conn, [w], self._fence)
                        commits += 1
                    except Exception as e:  # noqa: BLE001 - the caller re-raises it as is
                        w.error = e
                return commits, True
        except Exception as e:  # noqa: BLE001 - no connection: every write of the batch fails
            for w in batch:
                if w.error is None and not w.done.done():
                    w.error = e
            return 0, False

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
                commits, split = await self._commit(batch)
                if self._metrics is not None:
                    self._metrics.commit(time.perf_counter() - began, len(batch))
                self.stats.batch(
                    len(batch), sum(w.error is not None for w in batch), commits, split
                )
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
