"""Group commit: one writer thread commits every write queued at that moment in one transaction."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from daemon.errors import Unavailable
from daemon.observe.metrics import Metrics
from daemon.observe.threads import name_os_thread
from daemon.wake import LoopBell

log = structlog.get_logger(__name__)
#: A write: runs on the writer's connection inside the batch's transaction.
Apply = Callable[[sqlite3.Connection], Any]
#: Writes of one kind queued one after another: applied together (one `executemany` per
#: statement), returning one result per item, in order; raising fails the whole run.
ApplyMany = Callable[[sqlite3.Connection, list[Any]], list[Any]]
#: How long the thread waits before serving again after a crash, at most.
CRASH_BACKOFF_MAX_S = 1.0


@dataclass(slots=True)
class StoreStats:
    """Counters that show group commit at work."""

    commits: int = 0  #: transactions committed
    writes: int = 0  #: write requests committed
    splits: int = 0  #: failed batches retried one request per transaction
    wakes: int = 0  #: times a write woke the idle writer thread
    hand_backs: int = 0  #: times the writer thread woke the loop (batches ride along)

    def batch(self, size: int, failed: int, commits: int, split: bool) -> None:
        """Count one batch written in `commits` transactions; a split batch is logged."""
        self.commits += commits
        self.writes += size - failed
        if split:
            self.splits += 1
            log.warning("store_batch_split", batch=size, failed=failed)


class _Write(asyncio.Future[None]):
    """A queued write, and the future its caller awaits: one object per write, not two.

    The writer thread fills in `value` or `error`; the loop then sets the future's result
    (None: the outcome is read from the write, so an error nobody awaits is never logged as
    unretrieved). A cancelled caller cancels it, so the loop checks `done()` first.
    """

    __slots__ = ("alone", "apply", "error", "item", "many", "value")
    apply: Apply | None
    many: ApplyMany | None
    item: Any
    alone: bool  #: run outside any transaction (a PRAGMA, a probe), never batched
    value: Any  #: what the write returned (`result` is the future's own method)
    error: BaseException | None


def _finish(batch: list[_Write]) -> None:
    """Wake every waiter of `batch` that was not cancelled."""
    for w in batch:
        if not w.done():
            w.set_result(None)


def _apply(conn: sqlite3.Connection, batch: list[_Write]) -> list[Any]:
    """Apply `batch` in order; a run of writes of the same kind goes through its ApplyMany once."""
    results: list[Any] = []
    i = 0
    while i < len(batch):
        w = batch[i]
        if w.many is None:
            assert w.apply is not None
            results.append(w.apply(conn))
            i += 1
            continue
        j = i + 1
        while j < len(batch) and batch[j].many is w.many:
            j += 1
        out = w.many(conn, [x.item for x in batch[i:j]])
        if len(out) != j - i:
            raise RuntimeError(f"{w.many!r} returned {len(out)} results for {j - i} writes")
        results += out
        i = j
    return results


def _transaction(conn: sqlite3.Connection, batch: list[_Write]) -> None:
    """Apply and commit `batch` in the transaction the caller began, or roll it all back."""
    try:
        results = _apply(conn, batch)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
    for w, result in zip(batch, results, strict=True):
        w.value = result


def _commit_batch(conn: sqlite3.Connection, batch: list[_Write]) -> tuple[int, int, bool]:
    """Commit `batch` in one transaction, or each write alone if that fails.

    Return the number of commits, of writes that failed and whether the batch was split.
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
    except Exception as e:  # noqa: BLE001 - busy or broken: no request to blame, none retried
        return _fail_all(batch, e)
    try:
        _transaction(conn, batch)
        return 1, 0, False
    except Exception as e:  # noqa: BLE001 - every caller gets its own error below
        if len(batch) == 1:
            batch[0].error = e
            return 0, 1, False
    commits = 0
    for w in batch:
        try:
            conn.execute("BEGIN IMMEDIATE")
            _transaction(conn, [w])
            commits += 1
        except Exception as e:  # noqa: BLE001 - the caller re-raises it as is
            w.error = e
    return commits, len(batch) - commits, True


def _fail_all(batch: list[_Write], error: BaseException) -> tuple[int, int, bool]:
    """Fail every write of `batch` with `error`, none committed; as _commit_batch returns."""
    for w in batch:
        w.error = error
    return 0, len(batch), False


def _commit_alone(conn: sqlite3.Connection, w: _Write) -> tuple[int, int, bool]:
    """Commit one write of a single statement as its own transaction; as _commit_batch returns."""
    assert w.many is not None
    try:
        (w.value,) = w.many(conn, [w.item])
        return 1, 0, False
    except Exception as e:  # noqa: BLE001 - the caller re-raises it as is
        # A failed statement in autocommit mode has rolled itself back; this never runs
        # unless it left a transaction open all the same.
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        w.error = e
        return 0, 1, False


def _run_alone(conn: sqlite3.Connection, w: _Write) -> None:
    try:
        assert w.apply is not None
        w.value = w.apply(conn)
    except Exception as e:  # noqa: BLE001 - the caller re-raises it as is
        w.error = e


def statement(sql: str) -> ApplyMany:
    """Return an ApplyMany whose items are lists of `sql`'s parameter rows, run as one executemany."""

    def apply_many(conn: sqlite3.Connection, items: list[Any]) -> list[Any]:
        conn.executemany(sql, [row for rows in items for row in rows])
        return [None] * len(items)

    return apply_many


class GroupWriter:
    """Owns the write connection and its thread; callers queue writes and await their commit.

    The thread takes everything queued, commits it in one transaction and hands the whole
    batch back to the event loop with one wake-up (shared with the batches committed before
    the loop got round to it), then takes what queued meanwhile: batches form while the
    previous one commits, not when the loop gets round to it. The connection
    is the thread's alone from `start` on; it is closed by the thread when it stops.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        metrics: Metrics | None = None,
        *,
        checkpoint: Callable[[], None] | None = None,
        ring_every: int = 64,
        writes_per_commit: int = 32,
        one_statement: tuple[ApplyMany, ...] = (),
        refusal: Callable[[], BaseException | None] | None = None,
    ) -> None:
        self.stats = StoreStats()
        # Asked before each batch (on the thread): an error fails the whole batch with it,
        # and no transaction begins (a disk too full to write: see daemon.store.room).
        self._refusal = refusal
        # Asks for a WAL checkpoint off the commit path (WalCheckpointer.ring) every
        # `ring_every` commits, a batch of n writes counting 1 + n // writes_per_commit.
        self._checkpoint = checkpoint
        self._ring_every = ring_every
        self._per_commit = writes_per_commit
        self._until_ring = ring_every
        # ApplyManys that write with one statement: a batch of one such write runs it in
        # autocommit mode, its own transaction (no BEGIN and COMMIT: two calls fewer, each
        # of which gives up the GIL and takes it back).
        self._one_statement = one_statement
        self._metrics = metrics
        self._conn = conn
        self._lock = threading.Lock()
        # The idle thread blocks acquiring the bell; the one write that finds it idle rings
        # it (releases it). A bare lock costs a waker one C call, where a Condition's notify
        # and wait cost a dozen Python calls and a new lock per wait.
        self._bell = threading.Lock()
        self._bell.acquire()
        self._queue: deque[_Write] = deque()
        self._first = 0  # writes at the head of the queue put there by `submit_first`
        self._idle = False  # the thread waits on the bell: only then does a write ring it
        #: A checkpoint found the thread idle this loop turn: it is rung once the turn is over.
        self._ring_due = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._current: list[_Write] = []
        self._crashes = 0  # in a row: the backoff after the next one doubles
        self._posts_lock = threading.Lock()
        self._posts: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._posts_due = False  # a _run_posts is on its way to the loop
        # The thread wakes the loop with one byte on a pipe of its own (see LoopBell).
        self._wake: LoopBell | None = None

    @property
    def closed(self) -> bool:
        """Tell whether the writer has stopped for good."""
        return self._closing and (self._stopped is None or self._stopped.done())

    def start(self) -> None:
        """Start the writer thread, which posts its results to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._wake = LoopBell(self._loop, self._run_posts)
        self._thread = threading.Thread(target=self._main, name="workflowd-writer", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Commit what is queued, then stop the thread and wait for it to end."""
        with self._lock:
            self._closing = True
            self._ring()
        if self._stopped is None:  # never started: nothing was committed
            self._ended()
            return
        with anyio.CancelScope(shield=True):
            await self._stopped
            assert self._thread is not None
            await anyio.to_thread.run_sync(self._thread.join)

    async def submit(self, apply: Apply) -> Any:
        """Queue one write and return its result once it is committed (or raise its error)."""
        return await self._outcome(self._put(apply, None, None, False))

    async def submit_first(self, apply: Apply) -> Any:
        """Queue one write ahead of the writes waiting (after the earlier `submit_first` ones).

        For writes that must not wait behind a flood of others (a schedule's fires behind the
        checkpoints of the runs they started); it still waits for the batch being committed.
        Use it only for a write that no waiting write must precede.
        """
        return await self._outcome(self._put(apply, None, None, False, first=True))

    async def submit_many(self, many: ApplyMany, item: Any) -> Any:
        """Queue one write applied with `many` together with its neighbours of the same kind.

        `many` must be the same object each time for writes to be grouped.
        """
        return await self._outcome(self._put(None, many, item, False))

    def put_many(self, many: ApplyMany, item: Any) -> _Write:
        """Queue what `submit_many` queues, and return the write to await at once.

        Await it, then raise its `error` if it has one, else take its `value`: the flat path
        of a caller that would otherwise add a coroutine frame per write.
        """
        # _put, inline: this is every checkpoint's way in.
        if self._closing:
            raise Unavailable("the store is closed")
        loop = self._loop or asyncio.get_running_loop()
        w = _Write(loop=loop)
        w.apply, w.many, w.item, w.alone, w.value, w.error = None, many, item, False, None, None
        with self._lock:
            self._queue.append(w)
            if self._idle and not self._ring_due:
                # Rung after the other actors ready in this turn have put theirs: woken at
                # once, the thread would commit the first alone and contend for the GIL
                # while the loop makes the rest (more commits, each costing the loop a wake).
                self._ring_due = True
                loop.call_soon(self._ring_soon)
        return w

    def _ring_soon(self) -> None:
        with self._lock:
            self._ring_due = False
            self._ring()

    async def call(self, fn: Apply) -> Any:
        """Run `fn` on the writer's connection between batches, outside any transaction."""
        return await self._outcome(self._put(fn, None, None, True))

    def _put(
        self,
        apply: Apply | None,
        many: ApplyMany | None,
        item: Any,
        alone: bool,
        *,
        first: bool = False,
    ) -> _Write:
        if self._closing:
            raise Unavailable("the store is closed")
        w = _Write(loop=self._loop or asyncio.get_running_loop())
        w.apply, w.many, w.item, w.alone, w.value, w.error = apply, many, item, alone, None, None
        with self._lock:
            if first:  # behind the earlier `submit_first` writes, ahead of the rest
                self._queue.insert(self._first, w)
                self._first += 1
            else:
                self._queue.append(w)
            if self._idle:
                self._ring()
        return w

    def _ring(self) -> None:
        """Wake the idle thread (under `_lock`); a busy one looks at the queue before idling."""
        if self._idle:
            self._idle = False
            self.stats.wakes += 1
            self._bell.release()

    @staticmethod
    async def _outcome(w: _Write) -> Any:
        await w
        if w.error is not None:
            raise w.error
        return w.value

    # -- the thread -------------------------------------------------------------------------

    def _main(self) -> None:
        name_os_thread("wd-writer")
        try:
            while True:
                try:
                    self._serve()
                    return
                except BaseException as e:  # noqa: BLE001 - reported, and the thread goes on
                    self._crashes += 1
                    crashes = self._crashes
                    batch, self._current = self._current, []
                    if self._conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            self._conn.execute("ROLLBACK")
                    if not self._post(self._crashed, batch, e, crashes):
                        return
                    time.sleep(min(0.01 * 2**crashes, CRASH_BACKOFF_MAX_S))
        finally:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            if not self._post(self._ended) and self._wake is not None:
                self._wake.close()  # the loop is gone: nobody else closes the pipe

    def _serve(self) -> None:
        """Commit batches until closed and drained."""
        conn = self._conn
        queue = self._queue
        while True:
            self._lock.acquire()
            while not queue:
                if self._closing:
                    self._lock.release()
                    return
                self._idle = True
                self._lock.release()
                self._bell.acquire()  # rung by the write (or close) that finds us idle
                self._lock.acquire()
            # Up to the next write that must run alone, which then runs by itself: what
            # is taken is done (or failed) before anything behind it starts.
            if queue[0].alone:
                batch = [queue.popleft()]
            else:
                batch = []
                while queue and not queue[0].alone:
                    batch.append(queue.popleft())
            self._first = max(0, self._first - len(batch))
            self._current = batch
            self._lock.release()
            if batch[0].alone:
                _run_alone(conn, batch[0])
                posted = self._post(self._finished, batch)
            else:
                began = time.perf_counter()
                refused = self._refusal() if self._refusal is not None else None
                if refused is not None:
                    commits, failed, split = _fail_all(batch, refused)
                elif len(batch) == 1 and batch[0].many in self._one_statement:
                    commits, failed, split = _commit_alone(conn, batch[0])
                else:
                    commits, failed, split = _commit_batch(conn, batch)
                took = time.perf_counter() - began
                posted = self._post(self._committed, batch, commits, failed, split, took)
                if self._checkpoint is not None:  # after the post: the loop is woken first
                    self._until_ring -= commits + len(batch) // self._per_commit
                    if self._until_ring <= 0:
                        self._until_ring = self._ring_every
                        self._checkpoint()
            if not posted:
                return
            self._current = []
            self._crashes = 0  # the backoff doubles over crashes in a row only

    def _post(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run `fn(*args)` on the loop, after what was posted before; False if the loop is gone.

        A loop that has not yet taken the last post takes this one with it: batches committed
        while the loop is busy cost it one wake-up (and this thread one write to the pipe)
        between them, not one each.
        """
        loop = self._loop
        assert loop is not None
        with self._posts_lock:
            self._posts.append((fn, args))
            if self._posts_due:
                return not loop.is_closed()
            self._posts_due = True
        if loop.is_closed():  # nobody awaits these any more
            return False
        assert self._wake is not None
        return self._wake.ring()  # False once closed by _ended: it took the last post

    def _run_posts(self) -> None:
        assert self._wake is not None
        self._wake.clear()  # before taking the posts: a later one rings again
        with self._posts_lock:
            posts, self._posts = self._posts, []
            self._posts_due = False
        if posts:
            self.stats.hand_backs += 1
        for fn, args in posts:
            fn(*args)

    # -- back on the loop -------------------------------------------------------------------

    def _committed(
        self, batch: list[_Write], commits: int, failed: int, split: bool, took: float
    ) -> None:
        if self._metrics is not None:
            self._metrics.commit(took, len(batch))
        stats = self.stats
        if split:
            stats.batch(len(batch), failed, commits, split)
        else:  # the common case, inline: one call less per batch
            stats.commits += commits
            stats.writes += len(batch) - failed
        for w in batch:  # _finish, inline
            if not w.done():
                w.set_result(None)

    _finished = staticmethod(_finish)

    def _crashed(self, batch: list[_Write], error: BaseException, crashes: int) -> None:
        log.error(
            "store_writer_crashed",
            error=f"{type(error).__name__}: {error}",
            writes=len(batch),
            crashes=crashes,
            exc_info=error,
        )
        for w in batch:
            if w.error is None:
                w.error = Unavailable(
                    f"the store's writer crashed ({type(error).__name__}: {error})"
                    " before this write was confirmed"
                )
        _finish(batch)

    def _ended(self) -> None:
        with self._lock:
            self._closing = True
            left = list(self._queue)
            self._queue.clear()
            self._first = 0
        for w in [*self._current, *left]:
            if not w.done():
                w.error = Unavailable("the store closed before this write was committed")
                w.set_result(None)
        self._current = []
        if self._wake is not None:  # the thread has posted its last: the pipe is done
            self._wake.close()
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)
