"""The SQLite store: schema and migrations, the group-commit writer, inbox and history."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import functools
import os
import sqlite3
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite
import anyio
import msgspec
import structlog

from .clock import get_clock
from .errors import (
    BadRequest,
    ConfigError,
    Conflict,
    StoreLocked,
    Unavailable,
    WorkflowNotFound,
)

T = TypeVar("T")
log = structlog.get_logger(__name__)
FINAL = ("Finished", "Failed", "Cancelled")
_SYNCHRONOUS = {"normal": "NORMAL", "full": "FULL"}
_COLS = "id, name, status, data, state, error, attempt, next_run_at, created_at, updated_at"
_FINAL_ROWS = "status IN (?, ?, ?) AND updated_at < ?"

#: MIGRATIONS[n] takes the schema from version n to n + 1; append new ones, never edit old ones.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE workflows (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, status TEXT NOT NULL,
        data TEXT NOT NULL, state TEXT NOT NULL, error TEXT,
        attempt INTEGER NOT NULL DEFAULT 0, next_run_at REAL,
        created_at REAL NOT NULL, updated_at REAL NOT NULL,
        history_seq INTEGER NOT NULL DEFAULT 0  -- per-workflow counter: makes retention a range delete
    );
    CREATE INDEX workflows_status ON workflows (status);
    CREATE TABLE history (
        id INTEGER PRIMARY KEY, workflow_id TEXT NOT NULL, seq INTEGER NOT NULL,
        at REAL NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL
    );
    CREATE INDEX history_workflow ON history (workflow_id, seq);
    CREATE TABLE inbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT, workflow_id TEXT NOT NULL, event TEXT NOT NULL,
        thread_id TEXT NOT NULL, pc INTEGER NOT NULL, input TEXT NOT NULL, created_at REAL NOT NULL
    );
    CREATE INDEX inbox_workflow ON inbox (workflow_id);
    """,
]

_INSERT_WORKFLOW = (
    f"INSERT INTO workflows ({_COLS}, history_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (id) DO NOTHING"
)
_CHECKPOINT = (
    "UPDATE workflows SET status = ?, data = ?, state = ?, error = ?, attempt = ?, next_run_at = ?,"
    " updated_at = ?, history_seq = history_seq + ? WHERE id = ? RETURNING history_seq"
)
_SET_STATUS = (
    "UPDATE workflows SET status = ?, error = ?, attempt = COALESCE(?, attempt), next_run_at = ?,"
    " updated_at = ?, history_seq = history_seq + ? WHERE id = ? RETURNING history_seq"
)
_ADD_HISTORY = (
    "UPDATE workflows SET history_seq = history_seq + ? WHERE id = ? RETURNING history_seq"
)
_INSERT_HISTORY = "INSERT INTO history (workflow_id, seq, at, kind, detail) VALUES (?, ?, ?, ?, ?)"
_TRIM_HISTORY = "DELETE FROM history WHERE workflow_id = ? AND seq <= ?"

_encoder = msgspec.json.Encoder()
History = Sequence[tuple[str, dict[str, Any]]]
_Entries = Sequence[tuple[float, str, str]]
_Apply = Callable[[sqlite3.Connection], Any]


def _json(value: Any) -> str:
    return _encoder.encode(value).decode()


def _detail(text: str) -> dict[str, Any]:
    """Decode a history detail; a corrupt one is shown as its text rather than failing."""
    try:
        detail = msgspec.json.decode(text)
    except msgspec.DecodeError as e:
        return {"corrupt": text, "error": str(e)}
    return detail if isinstance(detail, dict) else {"value": detail}


@dataclass(slots=True)
class WorkflowRow:
    """One workflow as stored: its data and engine state as JSON text."""

    id: str
    name: str
    status: str
    data: str
    state: str
    error: str | None = None
    attempt: int = 0
    next_run_at: float | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


@dataclass(slots=True)
class HistoryRow:
    """One entry of a workflow's history."""

    id: int
    workflow_id: str
    at: float
    kind: str
    detail: dict[str, Any]


@dataclass(slots=True)
class InboxRow:
    """A callback that was acknowledged but not yet applied to its workflow."""

    id: int
    workflow_id: str
    event: str
    thread_id: str
    pc: int
    input: Any
    created_at: float


@dataclass(slots=True)
class StoreStats:
    """Counters that show group commit at work."""

    commits: int = 0  #: transactions committed
    writes: int = 0  #: write requests committed
    splits: int = 0  #: failed batches retried one request per transaction


@dataclass(slots=True, eq=False)
class _Write:
    apply: _Apply
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None


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


@contextlib.contextmanager
def _exclusive_lock(db: Path) -> Iterator[None]:
    lock = db.with_name(db.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLocked(f"another workflowd holds {db} (lock {lock})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


async def _connect(
    stack: contextlib.AsyncExitStack, path: Path, pragmas: str
) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, isolation_level=None)

    async def close() -> None:
        with anyio.CancelScope(shield=True):
            await conn.close()

    stack.push_async_callback(close)
    await conn.executescript(pragmas)
    return conn


async def _migrate(conn: aiosqlite.Connection, path: Path) -> None:
    (version,) = next(iter(await conn.execute_fetchall("PRAGMA user_version")))
    if version > len(MIGRATIONS):
        raise ConfigError(
            f"{path} has schema version {version}; this workflowd knows {len(MIGRATIONS)}"
        )
    for v in range(version, len(MIGRATIONS)):
        try:
            await conn.executescript(
                f"BEGIN IMMEDIATE; {MIGRATIONS[v]}; PRAGMA user_version = {v + 1}; COMMIT;"
            )
        except BaseException:
            await conn.rollback()
            raise


def _backup(src_path: Path, dest: Path) -> int:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        src = sqlite3.connect(src_path)
        try:
            dst = sqlite3.connect(tmp)
            try:
                src.backup(dst)
                # A self-contained file: no -wal beside it to copy along.
                dst.execute("PRAGMA journal_mode = DELETE")
            finally:
                dst.close()
        finally:
            src.close()
        os.link(tmp, dest)
        return os.stat(dest).st_size
    except FileExistsError:
        raise Conflict(f"{dest} exists; pick a new name") from None
    except (OSError, sqlite3.Error) as e:
        raise BadRequest(f"cannot write {dest}: {e}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class Store:
    """The daemon's SQLite database; one writer task commits every write in groups."""

    def __init__(
        self, path: Path, writer: aiosqlite.Connection, reader: aiosqlite.Connection, keep: int
    ) -> None:
        self.path = path
        self.stats = StoreStats()
        self._writer = writer
        self._reader = reader
        self._keep = keep
        self._queue: deque[_Write] = deque()
        self._wake = anyio.Event()
        self._stopped = anyio.Event()
        self._closing = False

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, path: Path | str, *, synchronous: str = "normal", history_keep: int = 1000
    ) -> AsyncIterator[Store]:
        """Lock, open and migrate the database at `path`; drain and release it on exit."""
        sync = _SYNCHRONOUS.get(synchronous)
        if sync is None:
            raise ConfigError(f"synchronous must be 'normal' or 'full', not {synchronous!r}")
        if history_keep < 1:
            raise ConfigError(f"history_keep must be at least 1, not {history_keep}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        async with contextlib.AsyncExitStack() as stack:
            stack.enter_context(_exclusive_lock(path))
            base = "PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL;"
            writer = await _connect(stack, path, f"{base} PRAGMA synchronous = {sync};")
            await _migrate(writer, path)
            reader = await _connect(stack, path, f"{base} PRAGMA query_only = 1;")
            store = cls(path, writer, reader, history_keep)
            failure: Exception | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(store._write_loop)
                try:
                    yield store
                except Exception as e:  # noqa: BLE001 - raised below, outside the task group
                    failure = e  # so the caller sees it as is, not inside an ExceptionGroup
                finally:
                    store._closing = True
                    store._wake.set()
                    with anyio.CancelScope(shield=True):
                        await store._stopped.wait()
            if failure is not None:
                raise failure

    async def _write_loop(self) -> None:
        batch: builtins.list[_Write] = []
        try:
            while self._queue or not self._closing:
                if not self._queue:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                batch = list(self._queue)
                self._queue.clear()
                commits, split = await _in_thread(
                    self._writer, functools.partial(_commit_batch, batch=batch)
                )
                failed = sum(w.error is not None for w in batch)
                self.stats.commits += commits
                self.stats.writes += len(batch) - failed
                if split:
                    self.stats.splits += 1
                    log.warning("store_batch_split", batch=len(batch), failed=failed)
                for w in batch:
                    w.done.set()
                batch = []
        finally:
            self._closing = True
            for w in [*batch, *self._queue]:
                if not w.done.is_set():
                    w.error = Unavailable("the store closed before this write was committed")
                    w.done.set()
            self._stopped.set()

    async def _submit(self, apply: _Apply) -> Any:
        if self._closing:
            raise Unavailable("the store is closed")
        w = _Write(apply)
        self._queue.append(w)
        self._wake.set()
        await w.done.wait()
        if w.error is not None:
            raise w.error
        return w.result

    def _append(self, conn: sqlite3.Connection, wid: str, last: int, entries: _Entries) -> None:
        """Insert history rows numbered up to `last`, then trim the workflow's oldest ones."""
        first = last - len(entries) + 1
        rows = [(wid, first + i, at, kind, detail) for i, (at, kind, detail) in enumerate(entries)]
        conn.executemany(_INSERT_HISTORY, rows)
        if last > self._keep:
            conn.execute(_TRIM_HISTORY, (wid, last - self._keep))

    async def _update(
        self, wid: str, sql: str, head: tuple[Any, ...], history: History, done: Sequence[int] = ()
    ) -> None:
        """Run an UPDATE ending in `updated_at`, `history_seq`, `id`; append history; drop inbox rows."""
        now = get_clock().now()
        entries = [(now, kind, _json(detail)) for kind, detail in history]
        params = (*head, now, len(entries), wid) if head else (len(entries), wid)
        inbox = [(i,) for i in done]

        def apply(conn: sqlite3.Connection) -> None:
            row = conn.execute(sql, params).fetchone()  # the rowcount check, without a SELECT
            if row is None:
                raise WorkflowNotFound(f"no workflow {wid!r}")
            if entries:
                self._append(conn, wid, row[0], entries)
            if inbox:
                conn.executemany("DELETE FROM inbox WHERE id = ?", inbox)

        await self._submit(apply)

    async def create(self, row: WorkflowRow, history: History = ()) -> bool:
        """Insert `row` unless its id exists; return whether it was inserted, once durable."""
        now = get_clock().now()
        entries = [(now, kind, _json(detail)) for kind, detail in history]
        params = (
            row.id, row.name, row.status, row.data, row.state, row.error, row.attempt,
            row.next_run_at, row.created_at or now, row.updated_at or now, len(entries),
        )  # fmt: skip

        def apply(conn: sqlite3.Connection) -> bool:
            if conn.execute(_INSERT_WORKFLOW, params).rowcount != 1:
                return False
            if entries:
                self._append(conn, row.id, len(entries), entries)
            return True

        created: bool = await self._submit(apply)
        return created

    async def checkpoint(
        self,
        workflow_id: str,
        *,
        status: str,
        data: str,
        state: str,
        error: str | None = None,
        attempt: int = 0,
        next_run_at: float | None = None,
        history: History = (),
        inbox_done: Sequence[int] = (),
    ) -> None:
        """Save data, state and status, append history and drop applied inbox rows, atomically."""
        head = (status, data, state, error, attempt, next_run_at)
        await self._update(workflow_id, _CHECKPOINT, head, history, inbox_done)

    async def set_status(
        self,
        workflow_id: str,
        *,
        status: str,
        error: str | None = None,
        attempt: int | None = None,
        next_run_at: float | None = None,
        history: History = (),
    ) -> None:
        """Change the status (and error, attempt, next run) and append history, atomically."""
        await self._update(workflow_id, _SET_STATUS, (status, error, attempt, next_run_at), history)

    async def add_history(self, workflow_id: str, kind: str, detail: dict[str, Any]) -> None:
        """Append one history entry to the workflow."""
        await self._update(workflow_id, _ADD_HISTORY, (), [(kind, detail)])

    async def inbox_put(
        self, workflow_id: str, event: str, input: Any, *, thread_id: str = "", pc: int = 0
    ) -> int:
        """Record a callback durably and return its inbox id."""
        params = (workflow_id, event, thread_id, pc, _json(input), get_clock().now())

        def apply(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                params,
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

        inbox_id: int = await self._submit(apply)
        return inbox_id

    async def inbox_done(self, ids: Sequence[int]) -> None:
        """Drop inbox rows without a checkpoint (for callbacks that were rejected)."""
        done = [(i,) for i in ids]
        await self._submit(lambda conn: conn.executemany("DELETE FROM inbox WHERE id = ?", done))

    async def delete_finished(self, older_than: float) -> int:
        """Delete workflows in a final status not updated since `older_than`; return how many."""
        params = (*FINAL, older_than)
        ids = f"SELECT id FROM workflows WHERE {_FINAL_ROWS}"

        def apply(conn: sqlite3.Connection) -> int:
            conn.execute(f"DELETE FROM history WHERE workflow_id IN ({ids})", params)
            conn.execute(f"DELETE FROM inbox WHERE workflow_id IN ({ids})", params)
            count: int = conn.execute(f"DELETE FROM workflows WHERE {_FINAL_ROWS}", params).rowcount
            return count

        deleted: int = await self._submit(apply)
        return deleted

    async def _read(self, sql: str, params: Sequence[Any] = ()) -> builtins.list[Any]:
        if self._closing and self._stopped.is_set():
            raise Unavailable("the store is closed")
        return builtins.list(await self._reader.execute_fetchall(sql, params))

    async def get(self, workflow_id: str) -> WorkflowRow | None:
        """Return the workflow with that id, or None."""
        rows = await self._read(f"SELECT {_COLS} FROM workflows WHERE id = ?", (workflow_id,))
        return WorkflowRow(*rows[0]) if rows else None

    async def list(
        self, *, status: str | None = None, name: str | None = None, limit: int = 100
    ) -> builtins.list[WorkflowRow]:
        """Return up to `limit` workflows, most recently updated first."""
        where = " AND ".join(
            c for c, v in (("status = ?", status), ("name = ?", name)) if v is not None
        )
        params = [v for v in (status, name) if v is not None]
        sql = f"SELECT {_COLS} FROM workflows {'WHERE ' + where if where else ''}"
        rows = await self._read(f"{sql} ORDER BY updated_at DESC LIMIT ?", [*params, limit])
        return [WorkflowRow(*r) for r in rows]

    async def unfinished(self, *, page: int = 1000) -> AsyncIterator[WorkflowRow]:
        """Yield every workflow not in a final status, reading `page` rows at a time."""
        after = ""
        while True:
            rows = await self._read(
                f"SELECT {_COLS} FROM workflows WHERE status NOT IN (?, ?, ?) AND id > ?"
                " ORDER BY id LIMIT ?",
                (*FINAL, after, page),
            )
            for r in rows:
                yield WorkflowRow(*r)
            if len(rows) < page:
                return
            after = rows[-1][0]

    async def history(self, workflow_id: str, *, limit: int = 1000) -> builtins.list[HistoryRow]:
        """Return the workflow's newest `limit` history entries, oldest first."""
        rows = await self._read(
            "SELECT id, workflow_id, at, kind, detail FROM history WHERE workflow_id = ?"
            " ORDER BY seq DESC LIMIT ?",
            (workflow_id, limit),
        )
        return [HistoryRow(i, w, at, k, _detail(d)) for i, w, at, k, d in reversed(rows)]

    async def inbox_pending(self, workflow_id: str | None = None) -> builtins.list[InboxRow]:
        """Return the callbacks not yet applied (of one workflow, or all), oldest first."""
        cols = "id, workflow_id, event, thread_id, pc, input, created_at"
        if workflow_id is None:
            rows = await self._read(f"SELECT {cols} FROM inbox ORDER BY id")
        else:
            sql = f"SELECT {cols} FROM inbox WHERE workflow_id = ? ORDER BY id"
            rows = await self._read(sql, (workflow_id,))
        out = []
        for i, w, e, t, pc, x, at in rows:
            try:
                out.append(InboxRow(i, w, e, t, pc, msgspec.json.decode(x), at))
            except msgspec.DecodeError as err:  # one bad row must not stop recovery
                log.error("inbox_corrupt", inbox_id=i, workflow_id=w, event_name=e, error=str(err))
        return out

    async def backup(self, dest: Path) -> int:
        """Write a consistent copy of the database to `dest` (which must not exist); return its size.

        The copy is made on a connection of its own, in one step, so it is one read transaction:
        writers go on meanwhile and cannot make it restart (as the sqlite3 shell's paged
        `.backup` does). It lands under a temporary name and is linked into place, so `dest`
        is either absent or complete, and an existing file (the database itself!) is never
        overwritten.
        """
        dest = Path(dest)
        if dest.exists():
            raise Conflict(f"{dest} exists; pick a new name")
        return await anyio.to_thread.run_sync(_backup, self.path, dest)

    async def counts(self) -> dict[str, int]:
        """Return how many workflows are in each status."""
        rows = await self._read("SELECT status, COUNT(*) FROM workflows GROUP BY status")
        return {status: n for status, n in rows}
