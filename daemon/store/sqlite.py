"""The SQLite store: workflows, their history and the inbox, read and written by checkpoint."""

from __future__ import annotations

import builtins
import contextlib
import functools
import sqlite3
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite
import anyio
import msgspec
import structlog

from daemon.clock import get_clock
from daemon.errors import (
    ConfigError,
    Conflict,
    ScheduleNotFound,
    StoreUnusable,
    Unavailable,
    WorkflowNotFound,
)
from daemon.observe.metrics import Metrics
from daemon.store import schema
from daemon.store.base import (
    FireRecord,
    History,
    HistoryRow,
    ScheduleFire,
    ScheduleRow,
    ScheduleUndo,
    SleepingState,
    WorkflowRow,
)
from daemon.store.reads import Dialect, Reads
from daemon.store.room import DiskRoom
from daemon.store.schema import FINAL, Entries
from daemon.store.walcheck import (
    AUTOCHECKPOINT_PAGES,
    RING_EVERY,
    WRITES_PER_COMMIT,
    WalCheckpointer,
)
from daemon.store.writer import ApplyMany, GroupWriter, statement

T = TypeVar("T")
log = structlog.get_logger(__name__)
#: The writer connection's page cache (negative: in KiB, as PRAGMA cache_size takes it).
WRITER_CACHE_KIB = -65_536
#: Waiting workflows, read in pages by id: `+status` has the planner walk the primary key
#: (the status index would need a sort).
_SLEEPING = "+status = 'Waiting'"
#: A schedule's fire records are trimmed back to FIRES_KEPT each time this many more are added.
TRIM_EVERY = 16
INSERT_INBOX = (
    "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
)
DROP_INBOX = "DELETE FROM inbox WHERE id = ?"
DROP_HOOK_RUN = "DELETE FROM hook_runs WHERE id = ?"


#: A history row numbered in SQL, from the counter its workflow's UPDATE just advanced: the
#: writer thread needs no SELECT for the numbers and builds no row (the loop made it whole).
INSERT_HISTORY_AT = (
    "INSERT INTO history (workflow_id, seq, at, kind, detail)"
    " SELECT id, history_seq - ?, ?, ?, ? FROM workflows WHERE id = ?"
)
#: The oldest history rows past `keep` (?2) of the workflows in a JSON array of ids (?1), in
#: one statement; a workflow under `keep` costs a primary-key lookup and nothing else.
TRIM_HISTORY_MANY = (
    "DELETE FROM history WHERE id IN (SELECT h.id FROM workflows w JOIN history h"
    " ON h.workflow_id = w.id AND h.seq <= w.history_seq - ?2"
    " WHERE w.id IN (SELECT value FROM json_each(?1)) AND w.history_seq > ?2)"
)


#: Which of a JSON array of ids are taken: one statement for any number of them.
EXISTING = "SELECT id FROM workflows WHERE id IN (SELECT value FROM json_each(?))"
#: `schedule_fire_many`'s statements, each over a JSON array of rows (?1), stamped with ?2.
#: json_extract returns a number exactly as it was encoded (tested), text unescaped.
FIRE_WORKFLOWS = (
    f"INSERT INTO workflows ({schema.COLS}, history_seq, not_before) SELECT "
    + ", ".join(
        f"coalesce(json_extract(value, '$[{i}]'), ?2)"
        if i in (8, 9)  # created_at, updated_at: the write's time unless given
        else f"json_extract(value, '$[{i}]')"
        for i in range(13)
    )
    + ", ?3 FROM json_each(?1) WHERE true ON CONFLICT (id) DO NOTHING"
)
#: The Resuming workflows a batch committed ahead of their time, not to run before it.
DEFERRED = "SELECT id, not_before FROM workflows WHERE status = 'Resuming' AND not_before > ?"
#: An early fire taken back: only while its workflow has not moved (it never ran).
UNDO_WORKFLOW = (
    "DELETE FROM workflows WHERE id = ? AND status = 'Resuming' AND not_before IS NOT NULL"
)
UNDO_HISTORY = "DELETE FROM history WHERE workflow_id = ?"
UNDO_RECORD = "DELETE FROM schedule_fires WHERE schedule = ? AND workflow_id = ?"
UNDO_SCHEDULE = (
    "UPDATE schedules SET last_nominal = ?, last_workflow_id = ?, last_fire_at = ? WHERE name = ?"
)
FIRE_HISTORY = (
    "INSERT INTO history (workflow_id, seq, at, kind, detail) SELECT json_extract(value, '$[0]'),"
    " json_extract(value, '$[1]'), ?2, json_extract(value, '$[2]'), json_extract(value, '$[3]')"
    " FROM json_each(?1)"
)
#: Rows [schedule, workflow id, nominal time or null, clear buffered (0/1), records added].
FIRE_ADVANCE = (
    "UPDATE schedules SET last_workflow_id = a.wid, last_fire_at = ?2,"
    " last_nominal = CASE WHEN a.nominal IS NULL THEN last_nominal"
    " ELSE max(last_nominal, a.nominal) END,"
    " buffered = CASE WHEN a.clear THEN NULL ELSE buffered END, fire_seq = fire_seq + a.n"
    " FROM (SELECT json_extract(value, '$[0]') AS name, json_extract(value, '$[1]') AS wid,"
    " json_extract(value, '$[2]') AS nominal, json_extract(value, '$[3]') AS clear,"
    " json_extract(value, '$[4]') AS n FROM json_each(?1)) AS a WHERE schedules.name = a.name"
)
#: Rows [schedule, offset from its new fire_seq, kind, nominal, workflow id, reason, count].
FIRE_RECORDS = (
    "INSERT INTO schedule_fires (schedule, seq, at, kind, nominal, workflow_id, reason, count)"
    " SELECT s.name, s.fire_seq - json_extract(j.value, '$[1]'), ?2,"
    " json_extract(j.value, '$[2]'), json_extract(j.value, '$[3]'),"
    " json_extract(j.value, '$[4]'), json_extract(j.value, '$[5]'), json_extract(j.value, '$[6]')"
    " FROM json_each(?1) j JOIN schedules s ON s.name = json_extract(j.value, '$[0]')"
)
#: The records past FIRES_KEPT (?2) of the schedules of FIRE_ADVANCE's rows (?1) whose
#: counter just passed a multiple of TRIM_EVERY (?3).
FIRE_TRIMS = (
    "DELETE FROM schedule_fires WHERE rowid IN (SELECT f.rowid FROM json_each(?1) j"
    " JOIN schedules s ON s.name = json_extract(j.value, '$[0]')"
    " AND s.fire_seq > ?2 AND s.fire_seq % ?3 < json_extract(j.value, '$[4]')"
    " JOIN schedule_fires f ON f.schedule = s.name AND f.seq <= s.fire_seq - ?2)"
)
KNOWN_SCHEDULES = "SELECT name FROM schedules WHERE name IN (SELECT value FROM json_each(?))"


@dataclass(slots=True)
class _Create:
    """One new workflow: INSERT_WORKFLOW's parameters and its history rows, numbered from 1."""

    wid: str
    params: tuple[Any, ...]
    history: builtins.list[tuple[Any, ...]]


#: One UPDATE of a workflow row (its parameters ending in `updated_at`, `history_seq`, `id`):
#: (id, parameters, INSERT_HISTORY_AT's rows, inbox rows to drop). A tuple, not a class: the
#: loop builds one per checkpoint and the writer thread only indexes it.
_Update = tuple[str, tuple[Any, ...], builtins.list[tuple[Any, ...]], builtins.list[tuple[int]]]
#: Shared by the updates that have no history or no inbox rows (never changed).
_NONE: builtins.list[Any] = []


def _connect_writer(path: Path, pragmas: str) -> sqlite3.Connection:
    """Open the writer thread's connection (made here, used only by that thread from then on)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.executescript(pragmas)
    except BaseException:
        conn.close()
        raise
    return conn


async def _stop_checkpoints(checkpointer: WalCheckpointer) -> None:
    with anyio.CancelScope(shield=True):  # a checkpoint under way may take a sync to finish
        await anyio.to_thread.run_sync(checkpointer.close)


class SQLiteStore(Reads):
    """The daemon's SQLite database; one writer thread commits every write in groups.

    Writes go to the writer thread's own sqlite3 connection; reads stay on aiosqlite
    connections (a reader and a lister), each with its own thread.
    """

    def __init__(
        self,
        path: Path,
        writer: sqlite3.Connection,
        reader: aiosqlite.Connection,
        keep: int,
        metrics: Metrics | None = None,
        lister: aiosqlite.Connection | None = None,
        checkpointer: WalCheckpointer | None = None,
    ) -> None:
        self.path = path
        self._flat: ApplyMany = self._flat_checkpoints  # kept: compared by identity
        self._writes = GroupWriter(
            writer,
            metrics,
            checkpoint=None if checkpointer is None else checkpointer.ring,
            ring_every=RING_EVERY,
            writes_per_commit=WRITES_PER_COMMIT,
            one_statement=(self._flat,),
            refusal=None if checkpointer is None else DiskRoom(path, checkpointer.truncate).refusal,
        )
        self.checkpointer = checkpointer
        self.stats = self._writes.stats
        #: Made once each, so that neighbouring writes of one kind are grouped by identity.
        self._many: dict[str, ApplyMany] = {
            sql: functools.partial(self._update_many, sql)
            for sql in (schema.CHECKPOINT, schema.SET_STATUS, schema.ADD_HISTORY)
        }
        self._checkpoints = self._many[schema.CHECKPOINT]
        self._creates: ApplyMany = self._create_many  # one bound method, kept: compared by identity
        self._drop_inbox = statement(DROP_INBOX)
        self._drop_hook_runs = statement(DROP_HOOK_RUN)
        self._reader = reader
        #: Pages of `list` are read on a connection of their own: a flood of them queues
        #: behind itself, not in front of ping's counts or a send's lookups.
        self._lister = lister or reader
        self._keep = keep

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        path: Path | str,
        *,
        synchronous: str = "normal",
        history_keep: int = 1000,
        metrics: Metrics | None = None,
    ) -> AsyncIterator[SQLiteStore]:
        """Lock, open and migrate the database at `path`; drain and release it on exit.

        Anything that keeps the database from being written (a read-only or immutable file,
        a folder the daemon may not write) raises StoreUnusable here, naming the file, so the
        daemon refuses to start rather than fail after it reported READY.
        """
        sync = schema.SYNCHRONOUS.get(synchronous)
        if sync is None:
            raise ConfigError(f"synchronous must be 'normal' or 'full', not {synchronous!r}")
        if history_keep < 1:
            raise ConfigError(f"history_keep must be at least 1, not {history_keep}")
        path = Path(path)
        async with contextlib.AsyncExitStack() as stack:
            schema.make_folder(path.parent)
            stack.enter_context(schema.exclusive_lock(path))
            schema.check_files(path)
            base = "PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL;"
            try:
                migrator = await schema.connect(stack, path, base)
                await schema.migrate(migrator, path)
                await migrator.close()
                # The writer's own automatic checkpoint is only a safety net: checkpoints run
                # on the checkpointer's connection and thread (walcheck.py says why).
                writer = await anyio.to_thread.run_sync(
                    _connect_writer,
                    path,
                    f"{base} PRAGMA synchronous = {sync};"
                    f" PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_PAGES};"
                    # 64 MB, not SQLite's 2 MB: a batch of fires updates five indexes whose
                    # pages would otherwise be read back from the file on every batch.
                    f" PRAGMA cache_size = {WRITER_CACHE_KIB};"
                    + schema.checkpoint_view(history_keep),
                )
                stack.callback(writer.close)  # the writer thread closes it; this if it never ran
                checkpointer = WalCheckpointer(
                    await anyio.to_thread.run_sync(
                        _connect_writer, path, f"{base} PRAGMA synchronous = {sync};"
                    )
                )
                # Stopped after the writer, whose last commits may still ring (the writer is
                # closed in the body below, before the stack unwinds).
                stack.push_async_callback(_stop_checkpoints, checkpointer)
                reader = await schema.connect(stack, path, f"{base} PRAGMA query_only = 1;")
                lister = await schema.connect(stack, path, f"{base} PRAGMA query_only = 1;")
            except (OSError, sqlite3.Error) as e:
                raise StoreUnusable(f"cannot open {path}: {type(e).__name__}: {e}") from None
            store = cls(path, writer, reader, history_keep, metrics, lister, checkpointer)
            checkpointer.start()
            store._writes.start()
            try:
                yield store
            finally:
                await store._writes.close()

    def _append(self, conn: sqlite3.Connection, wid: str, last: int, entries: Entries) -> None:
        """Insert history rows numbered up to `last`, then trim the workflow's oldest ones."""
        first = last - len(entries) + 1
        rows = [(wid, first + i, at, kind, detail) for i, (at, kind, detail) in enumerate(entries)]
        conn.executemany(schema.INSERT_HISTORY, rows)
        if last > self._keep:
            conn.execute(schema.TRIM_HISTORY, (wid, last - self._keep))

    async def _update(
        self, wid: str, sql: str, head: tuple[Any, ...], history: History, done: Sequence[int] = ()
    ) -> None:
        """Run an UPDATE ending in `updated_at`, `history_seq`, `id`; append history; drop inbox rows."""
        await self._writes.submit_many(self._many[sql], _update_of(wid, head, history, done))

    def _update_one(self, conn: sqlite3.Connection, sql: str, u: _Update) -> None:
        wid, params, history, inbox = u
        row = conn.execute(sql, params).fetchone()  # the rowcount check, without a SELECT
        if row is None:
            raise WorkflowNotFound(f"no workflow {wid!r}")
        if history:
            conn.executemany(INSERT_HISTORY_AT, history)
            if row[0] > self._keep:
                conn.execute(schema.TRIM_HISTORY, (wid, row[0] - self._keep))
        if inbox:
            conn.executemany(DROP_INBOX, inbox)

    def _update_many(
        self, sql: str, conn: sqlite3.Connection, updates: builtins.list[_Update]
    ) -> builtins.list[None]:
        """Apply a run of updates with one `executemany` per statement.

        A workflow updated twice in the run starts a new round at its second update, so
        its history numbers follow the order of its updates. A run that misses a workflow
        raises, and the writer then retries its writes one by one, naming the missing one.
        """
        if len(updates) == 1:
            self._update_one(conn, sql, updates[0])
            return [None]
        plain = sql.removesuffix(" RETURNING history_seq")
        start = 0
        while start < len(updates):
            seen: set[str] = set()
            end = start
            while end < len(updates) and updates[end][0] not in seen:
                seen.add(updates[end][0])
                end += 1
            run = updates[start:end] if start or end < len(updates) else updates
            if conn.executemany(plain, [u[1] for u in run]).rowcount != len(run):
                raise WorkflowNotFound("a batched update missed its workflow")
            history = [r for u in run for r in u[2]]
            if history:
                conn.executemany(INSERT_HISTORY_AT, history)
                conn.execute(TRIM_HISTORY_MANY, (schema.to_json([u[0] for u in run]), self._keep))
            inbox = [i for u in run for i in u[3]]
            if inbox:
                conn.executemany(DROP_INBOX, inbox)
            start = end
        return [None] * len(updates)

    async def create(self, row: WorkflowRow, history: History = ()) -> bool:
        """Insert `row` unless its id exists; return whether it was inserted, once durable."""
        now = get_clock().now()
        rows = [
            (row.id, i + 1, now, kind, schema.to_json(detail))
            for i, (kind, detail) in enumerate(history)
        ]
        params = (
            row.id, row.name, row.status, row.data, row.state, row.error, row.attempt,
            row.next_run_at, row.created_at or now, row.updated_at or now, row.parent,
            row.deadline, len(rows),
        )  # fmt: skip
        created: bool = await self._writes.submit_many(self._creates, _Create(row.id, params, rows))
        return created

    def _create_many(
        self, conn: sqlite3.Connection, creates: builtins.list[_Create]
    ) -> builtins.list[bool]:
        """Insert a run of new workflows and their history with one `executemany` each.

        Which ids exist already is asked once for the run; of two creates of one id in a run
        the first wins, as it would one at a time. True where inserted.
        """
        if len(creates) == 1:
            (c,) = creates
            if conn.execute(schema.INSERT_WORKFLOW, c.params).rowcount != 1:
                return [False]
            fresh = creates
            made = [True]
        else:
            ids = schema.to_json([c.wid for c in creates])
            taken = {wid for (wid,) in conn.execute(EXISTING, (ids,))}
            made = []
            for c in creates:
                made.append(c.wid not in taken)
                taken.add(c.wid)
            fresh = [c for c, new in zip(creates, made, strict=True) if new]
            if conn.executemany(schema.INSERT_WORKFLOW, [c.params for c in fresh]).rowcount != len(
                fresh
            ):
                raise RuntimeError("a batched create found its id taken")  # retried one by one
        history = [r for c in fresh for r in c.history]
        if history:
            conn.executemany(schema.INSERT_HISTORY, history)
            trims = [(c.wid, len(c.history) - self._keep) for c in fresh]
            trims = [t for t in trims if t[1] > 0]
            if trims:
                conn.executemany(schema.TRIM_HISTORY, trims)
        return made

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
        # The hot path of every step, flat: the update is built here and the write awaited
        # here (what _update and _update_of do, less two coroutine frames and two calls).
        now = get_clock().now()
        n = len(history)
        if n <= 1 and not inbox_done:  # the common case: one row, one statement
            kind: str | None = None
            text: str | None = None
            if n:
                ((kind, detail),) = history
                text = _encode(detail).decode()
            w = self._writes.put_many(
                self._flat,
                (workflow_id, status, data, state, error, attempt, next_run_at, now, n, kind, text),
            )
            await w
            if w.error is not None:
                raise w.error
            return
        if n == 1:
            ((kind, detail),) = history
            rows = [(0, now, kind, _encode(detail).decode(), workflow_id)]
        elif n:
            rows = _history_rows(workflow_id, now, history)
        else:
            rows = _NONE
        w = self._writes.put_many(
            self._checkpoints,
            (
                workflow_id,
                (status, data, state, error, attempt, next_run_at, now, n, workflow_id),
                rows,
                [(i,) for i in inbox_done] if inbox_done else _NONE,
            ),
        )
        await w
        if w.error is not None:
            raise w.error

    @staticmethod
    def _flat_checkpoints(
        conn: sqlite3.Connection, rows: builtins.list[Any]
    ) -> builtins.list[None]:
        """Apply a run of common-case checkpoints with one statement (one executemany).

        A run that misses a workflow raises, and the writer then retries its writes one by
        one, naming the missing one.
        """
        try:
            if len(rows) == 1:
                conn.execute(schema.INSERT_CHECKPOINT, rows[0])
            else:
                conn.executemany(schema.INSERT_CHECKPOINT, rows)
        except sqlite3.IntegrityError as e:
            if str(e) != schema.MISSING:
                raise
            if len(rows) == 1:
                raise WorkflowNotFound(f"no workflow {rows[0][0]!r}") from None
            raise WorkflowNotFound("a batched update missed its workflow") from None
        return [None] * len(rows)

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
        await self._update(
            workflow_id, schema.SET_STATUS, (status, error, attempt, next_run_at), history
        )

    async def add_history(self, workflow_id: str, kind: str, detail: dict[str, Any]) -> None:
        """Append one history entry to the workflow."""
        await self._update(workflow_id, schema.ADD_HISTORY, (), [(kind, detail)])

    async def history(self, workflow_id: str, *, limit: int = 1000) -> builtins.list[HistoryRow]:
        """Return the workflow's newest `limit` history entries (`history_keep` at most), oldest first.

        The checkpoint's trigger trims every HISTORY_TRIM_EVERY rows, not on each one: the
        rows past `history_keep` that wait for that trim are never shown.
        """
        return await super().history(workflow_id, limit=min(limit, self._keep))

    async def inbox_put(
        self, workflow_id: str, event: str, input: Any, *, thread_id: str = "", pc: int = 0
    ) -> int:
        """Record a callback durably and return its inbox id."""
        params = (workflow_id, event, thread_id, pc, _encode(input).decode(), get_clock().now())
        w = self._writes.put_many(self._inbox_puts, params)  # flat: one per callback
        await w
        if w.error is not None:
            raise w.error
        inbox_id: int = w.value
        return inbox_id

    @staticmethod
    def _inbox_puts(conn: sqlite3.Connection, rows: builtins.list[Any]) -> builtins.list[int]:
        """Insert inbox rows with one executemany; return their ids, in order.

        This connection is the database's only writer and holds its write lock, so the ids
        AUTOINCREMENT hands out to one statement's rows follow one another.
        """
        conn.executemany(INSERT_INBOX, rows)
        (last,) = conn.execute("SELECT last_insert_rowid()").fetchone()
        return builtins.list(range(last - len(rows) + 1, last + 1))

    async def inbox_done(self, ids: Sequence[int]) -> None:
        """Drop inbox rows without a checkpoint (for callbacks that were rejected)."""
        await self._writes.submit_many(self._drop_inbox, [(i,) for i in ids])

    async def delete_finished(self, older_than: float) -> int:
        """Delete workflows in a final status not updated since `older_than`; return how many."""
        params = (*FINAL, older_than)
        ids = f"SELECT id FROM workflows WHERE {schema.FINAL_ROWS}"

        def apply(conn: sqlite3.Connection) -> int:
            conn.execute(f"DELETE FROM history WHERE workflow_id IN ({ids})", params)
            conn.execute(f"DELETE FROM inbox WHERE workflow_id IN ({ids})", params)
            count: int = conn.execute(
                f"DELETE FROM workflows WHERE {schema.FINAL_ROWS}", params
            ).rowcount
            return count

        deleted: int = await self._writes.submit(apply)
        return deleted

    async def _read(
        self, sql: str, params: Sequence[Any] = (), *, on: aiosqlite.Connection | None = None
    ) -> builtins.list[Any]:
        if self._writes.closed:
            raise Unavailable("the store is closed")
        return builtins.list(await (on or self._reader).execute_fetchall(sql, params))

    _dialect = Dialect(numbered=False, list_query=schema.list_query)

    async def _rows(
        self, sql: str, params: Sequence[Any] = (), *, lister: bool = False
    ) -> builtins.list[Any]:
        return await self._read(sql, params, on=self._lister if lister else None)

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
        return await anyio.to_thread.run_sync(schema.backup_file, self.path, dest)

    # -- schedules --------------------------------------------------------------------------

    async def schedules_load(self, names: Sequence[str], now: float) -> builtins.list[ScheduleRow]:
        """Return the named schedules' state, adding the new ones as handled up to `now`."""
        added = [(name, now, now) for name in names]
        wanted = builtins.list(names)

        def apply(conn: sqlite3.Connection) -> builtins.list[Any]:
            conn.executemany(schema.ADD_SCHEDULE, added)
            rows = []
            for i in range(0, len(wanted), 500):  # under SQLite's limit of bound parameters
                chunk = wanted[i : i + 500]
                marks = ", ".join("?" * len(chunk))
                sql = f"SELECT {schema.SCHEDULE_COLS} FROM schedules WHERE name IN ({marks})"
                rows += conn.execute(sql, chunk).fetchall()
            return rows

        rows = await self._writes.submit(apply)
        return [ScheduleRow(n, last, bool(p), b, w, f) for n, last, p, b, w, f in rows]

    def _advance(
        self,
        conn: sqlite3.Connection,
        name: str,
        sets: dict[str, Any],
        records: Sequence[FireRecord],
    ) -> None:
        """Update a schedule's row (`column = ?` each), append its records, drop the oldest."""
        columns = [f"{c} = MAX({c}, ?)" if c == "last_nominal" else f"{c} = ?" for c in sets]
        sql = (
            f"UPDATE schedules SET {', '.join([*columns, 'fire_seq = fire_seq + ?'])}"
            " WHERE name = ? RETURNING fire_seq"
        )
        row = conn.execute(sql, (*sets.values(), len(records), name)).fetchone()
        if row is None:
            raise ScheduleNotFound(f"no schedule {name!r}")
        first = row[0] - len(records) + 1
        conn.executemany(
            schema.INSERT_FIRE,
            [
                (name, first + i, r.at, r.kind, r.nominal, r.workflow_id, r.reason, r.count)
                for i, r in enumerate(records)
            ],
        )
        # Trimmed every TRIM_EVERY records, not on each: a fire then costs one statement less.
        if row[0] > schema.FIRES_KEPT and (first - 1) // TRIM_EVERY != row[0] // TRIM_EVERY:
            conn.execute(schema.TRIM_FIRES, (name, row[0] - schema.FIRES_KEPT))

    async def schedule_fire(
        self,
        name: str,
        row: WorkflowRow,
        history: History = (),
        *,
        last_nominal: float | None = None,
        clear_buffered: bool = False,
        records: Sequence[FireRecord] = (),
    ) -> bool:
        """Insert the workflow and advance its schedule in one transaction (a crash keeps both
        or neither); an existing id is left as is, the schedule still advances. True if inserted.
        """
        now = get_clock().now()
        entries = [(now, kind, schema.to_json(detail)) for kind, detail in history]
        params = (
            row.id, row.name, row.status, row.data, row.state, row.error, row.attempt,
            row.next_run_at, row.created_at or now, row.updated_at or now, row.parent,
            row.deadline, len(entries),
        )  # fmt: skip
        sets: dict[str, Any] = {"last_workflow_id": row.id, "last_fire_at": now}
        if last_nominal is not None:
            sets["last_nominal"] = last_nominal
        if clear_buffered:
            sets["buffered"] = None

        def apply(conn: sqlite3.Connection) -> bool:
            created = conn.execute(schema.INSERT_WORKFLOW, params).rowcount == 1
            if created and entries:
                self._append(conn, row.id, len(entries), entries)
            self._advance(conn, name, sets, records)
            return created

        created: bool = await self._writes.submit(apply)
        return created

    async def schedule_fire_many(self, fires: Sequence[ScheduleFire]) -> builtins.list[bool]:
        """Insert each fire's workflow and advance its schedule, all in one transaction.

        An existing id is left as is and its schedule still advances; True where inserted (of
        two fires of one id, the first). The records' `at` is stamped inside the transaction:
        when the fire was committed. The write goes ahead of the writes waiting (the runs of
        earlier fires must not make these late).
        """
        return await self._fire_many(fires, None)

    async def schedule_fire_early(
        self, fires: Sequence[ScheduleFire], not_before: float
    ) -> builtins.list[bool]:
        """Do `schedule_fire_many`, the workflows to run from `not_before` on, not before.

        Stamped max(the commit, `not_before`): the records, `last_fire_at` and the rows' times
        say when the fire takes effect.
        """
        return await self._fire_many(fires, not_before)

    async def schedule_undo(
        self, undos: Sequence[ScheduleUndo], *, paused: str | None = None
    ) -> builtins.list[bool]:
        """Take back fires committed early and not yet run, in one transaction (see base)."""
        undos = builtins.list(undos)

        def apply(conn: sqlite3.Connection) -> builtins.list[bool]:
            out = []
            for u in undos:
                gone = conn.execute(UNDO_WORKFLOW, (u.workflow_id,)).rowcount == 1
                if gone:
                    conn.execute(UNDO_HISTORY, (u.workflow_id,))
                    conn.execute(UNDO_RECORD, (u.name, u.workflow_id))
                    conn.execute(
                        UNDO_SCHEDULE, (u.last_nominal, u.last_workflow_id, u.last_fire_at, u.name)
                    )
                out.append(gone)
            if paused is not None:
                self._advance(conn, paused, {"paused": 1}, ())
            return out

        done: builtins.list[bool] = await self._writes.submit_first(apply)
        return done

    async def deferred_starts(self, now: float) -> dict[str, float]:
        """Return the Resuming workflows not to run before a time after `now`: id -> time."""
        return dict(await self._read(DEFERRED, (now,)))

    async def _fire_many(
        self, fires: Sequence[ScheduleFire], not_before: float | None
    ) -> builtins.list[bool]:
        clock = get_clock()
        fires = builtins.list(fires)

        def apply(conn: sqlite3.Connection) -> builtins.list[bool]:
            # Each table takes the whole batch in one statement over a JSON array: one step,
            # so the writer thread gives up the GIL (and waits to get it back from a busy
            # loop) once per table, not once per row as `executemany` does.
            stamp = clock.now() if not_before is None else max(clock.now(), not_before)
            ids = [f.row.id for f in fires]
            taken = {wid for (wid,) in conn.execute(EXISTING, (_encode(ids).decode(),))}
            created = []
            for wid in ids:
                created.append(wid not in taken)
                taken.add(wid)
            fresh = [f for f, made in zip(fires, created, strict=True) if made]
            if fresh:
                rows = [
                    (r.id, r.name, r.status, r.data, r.state, r.error, r.attempt, r.next_run_at,
                     r.created_at or None, r.updated_at or None, r.parent, r.deadline,
                     len(f.history))
                    for f in fresh
                    for r in (f.row,)
                ]  # fmt: skip
                conn.execute(FIRE_WORKFLOWS, (_encode(rows).decode(), stamp, not_before))
                history = [
                    (f.row.id, i + 1, kind, _encode(detail).decode())
                    for f in fresh
                    for i, (kind, detail) in enumerate(f.history)
                ]
                if history:
                    conn.execute(FIRE_HISTORY, (_encode(history).decode(), stamp))
            advances = [
                (f.name, f.row.id, f.last_nominal, int(f.clear_buffered), len(f.records))
                for f in fires
            ]
            batch = _encode(advances).decode()
            if conn.execute(FIRE_ADVANCE, (batch, stamp)).rowcount != len(fires):
                names = _encode([f.name for f in fires]).decode()
                known = {n for (n,) in conn.execute(KNOWN_SCHEDULES, (names,))}
                missing = next(f.name for f in fires if f.name not in known)
                raise ScheduleNotFound(f"no schedule {missing!r}")
            records = [
                (f.name, n - 1 - i, r.kind, r.nominal, r.workflow_id, r.reason, r.count)
                for f in fires
                for n in (len(f.records),)
                for i, r in enumerate(f.records)
            ]
            if records:
                conn.execute(FIRE_RECORDS, (_encode(records).decode(), stamp))
                # Trimmed every TRIM_EVERY records: the schedules whose counter just passed a
                # multiple of it.
                conn.execute(FIRE_TRIMS, (batch, schema.FIRES_KEPT, TRIM_EVERY))
            return created

        created: builtins.list[bool] = await self._writes.submit_first(apply)
        return created

    async def schedule_note(
        self,
        name: str,
        *,
        last_nominal: float | None = None,
        paused: bool | None = None,
        buffered: float | None = None,
        records: Sequence[FireRecord] = (),
    ) -> None:
        """Advance, pause, resume or buffer a schedule and append its records, atomically."""
        sets: dict[str, Any] = {}
        if last_nominal is not None:
            sets["last_nominal"] = last_nominal
        if paused is not None:
            sets["paused"] = int(paused)
        if buffered is not None:
            sets["buffered"] = buffered
        await self._writes.submit(lambda conn: self._advance(conn, name, sets, records))

    async def schedule_fires(self, name: str, *, limit: int = 100) -> builtins.list[FireRecord]:
        """Return a schedule's newest `limit` kept fires and skips, oldest first."""
        rows = await self._read(
            "SELECT at, kind, nominal, workflow_id, reason, count FROM schedule_fires"
            " WHERE schedule = ? ORDER BY seq DESC LIMIT ?",
            (name, limit),
        )
        return [FireRecord(*r) for r in reversed(rows)]

    # -- hooks and gauges -------------------------------------------------------------------

    async def hook_claim(self, hook_id: int) -> None:
        """Mark an ending's hook as started, durably, before it runs."""
        now = get_clock().now()
        await self._writes.submit(
            lambda conn: conn.execute(
                "UPDATE hook_runs SET started_at = ? WHERE id = ?", (now, hook_id)
            )
        )

    async def hooks_done(self, hook_ids: Sequence[int]) -> None:
        """Forget endings whose hooks ran (or that have none)."""
        w = self._writes.put_many(self._drop_hook_runs, [(i,) for i in hook_ids])  # one per end
        await w
        if w.error is not None:
            raise w.error

    # -- recovery of sleeping workflows (reads only) ----------------------------------------

    async def sleeping(
        self, *, page: int = 5000, after: str = "", limit: int | None = None
    ) -> AsyncIterator[builtins.list[WorkflowRow]]:
        """Yield the Waiting workflows with an id over `after` (up to `limit`), in id order."""
        async for rows in self._by_id(schema.COLS, _SLEEPING, (), page, after, limit):
            yield [WorkflowRow(*r) for r in rows]

    async def sleeping_states(
        self, *, page: int = 5000, after: str = ""
    ) -> AsyncIterator[builtins.list[SleepingState]]:
        """Yield id, type, deadline and state of each Waiting workflow with an id over `after`."""
        async for rows in self._by_id("id, name, deadline, state", _SLEEPING, (), page, after):
            yield rows

    async def awake(self, *, page: int = 1000) -> AsyncIterator[WorkflowRow]:
        """Yield every unfinished workflow that is not Waiting, a page at a time."""
        where = "+status NOT IN (?, ?, ?, 'Waiting')"
        async for rows in self._by_id(schema.COLS, where, FINAL, page):
            for r in rows:
                yield WorkflowRow(*r)


def _update_of(wid: str, head: tuple[Any, ...], history: History, done: Sequence[int]) -> _Update:
    """Build an update's parameters and rows, whole, on the caller's side."""
    now = get_clock().now()
    rows = _history_rows(wid, now, history) if history else _NONE
    params = (*head, now, len(history), wid) if head else (len(history), wid)
    return (wid, params, rows, [(i,) for i in done] if done else _NONE)


def _history_rows(wid: str, now: float, history: History) -> builtins.list[tuple[Any, ...]]:
    """Return INSERT_HISTORY_AT's rows for `history`, the last one right at the new counter."""
    n = len(history)
    return [
        (n - 1 - i, now, kind, _encode(detail).decode(), wid)
        for i, (kind, detail) in enumerate(history)
    ]


#: The encoder schema.to_json uses (the same default settings), called straight: one call less
#: per history entry.
_encode = msgspec.json.Encoder().encode
