"""The SQLite store: workflows, their history and the inbox, read and written by checkpoint."""

from __future__ import annotations

import builtins
import contextlib
import functools
import sqlite3
from collections.abc import AsyncIterator, Sequence
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
from daemon.observe.hooks import HookRow
from daemon.observe.metrics import Metrics
from daemon.store import schema
from daemon.store.base import (
    FireRecord,
    History,
    HistoryRow,
    InboxRow,
    Position,
    ScheduleFire,
    ScheduleRow,
    WorkflowRow,
)
from daemon.store.schema import FINAL, Entries
from daemon.store.writer import GroupWriter

T = TypeVar("T")
log = structlog.get_logger(__name__)
#: A schedule's fire records are trimmed back to FIRES_KEPT each time this many more are added.
TRIM_EVERY = 16


class SQLiteStore:
    """The daemon's SQLite database; one writer task commits every write in groups."""

    def __init__(
        self,
        path: Path,
        writer: aiosqlite.Connection,
        reader: aiosqlite.Connection,
        keep: int,
        metrics: Metrics | None = None,
        lister: aiosqlite.Connection | None = None,
    ) -> None:
        self.path = path
        self._writer = writer
        self._writes = GroupWriter(writer, metrics)
        self.stats = self._writes.stats
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
                writer = await schema.connect(stack, path, f"{base} PRAGMA synchronous = {sync};")
                await schema.migrate(writer, path)
                reader = await schema.connect(stack, path, f"{base} PRAGMA query_only = 1;")
                lister = await schema.connect(stack, path, f"{base} PRAGMA query_only = 1;")
            except (OSError, sqlite3.Error) as e:
                raise StoreUnusable(f"cannot open {path}: {type(e).__name__}: {e}") from None
            store = cls(path, writer, reader, history_keep, metrics, lister)
            failure: Exception | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(store._writes.run)
                try:
                    yield store
                except Exception as e:  # noqa: BLE001 - raised below, outside the task group
                    failure = e  # so the caller sees it as is, not inside an ExceptionGroup
                finally:
                    await store._writes.close()
            if failure is not None:
                raise failure

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
        now = get_clock().now()
        entries = [(now, kind, schema.to_json(detail)) for kind, detail in history]
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

        await self._writes.submit(apply)

    async def create(self, row: WorkflowRow, history: History = ()) -> bool:
        """Insert `row` unless its id exists; return whether it was inserted, once durable."""
        now = get_clock().now()
        entries = [(now, kind, schema.to_json(detail)) for kind, detail in history]
        params = (
            row.id, row.name, row.status, row.data, row.state, row.error, row.attempt,
            row.next_run_at, row.created_at or now, row.updated_at or now, row.parent,
            row.deadline, len(entries),
        )  # fmt: skip

        def apply(conn: sqlite3.Connection) -> bool:
            if conn.execute(schema.INSERT_WORKFLOW, params).rowcount != 1:
                return False
            if entries:
                self._append(conn, row.id, len(entries), entries)
            return True

        created: bool = await self._writes.submit(apply)
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
        await self._update(workflow_id, schema.CHECKPOINT, head, history, inbox_done)

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

    async def inbox_put(
        self, workflow_id: str, event: str, input: Any, *, thread_id: str = "", pc: int = 0
    ) -> int:
        """Record a callback durably and return its inbox id."""
        params = (workflow_id, event, thread_id, pc, schema.to_json(input), get_clock().now())

        def apply(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                params,
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

        inbox_id: int = await self._writes.submit(apply)
        return inbox_id

    async def inbox_done(self, ids: Sequence[int]) -> None:
        """Drop inbox rows without a checkpoint (for callbacks that were rejected)."""
        done = [(i,) for i in ids]
        await self._writes.submit(
            lambda conn: conn.executemany("DELETE FROM inbox WHERE id = ?", done)
        )

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

    async def get(self, workflow_id: str) -> WorkflowRow | None:
        """Return the workflow with that id, or None."""
        rows = await self._read(f"SELECT {schema.COLS} FROM workflows WHERE id = ?", (workflow_id,))
        return WorkflowRow(*rows[0]) if rows else None

    async def list(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        limit: int = 100,
        parent: str | None = None,
    ) -> builtins.list[WorkflowRow]:
        """Return up to `limit` workflows, most recently updated first."""
        rows, _ = await self.page(status=status, name=name, limit=limit, parent=parent)
        return rows

    async def page(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        limit: int = 100,
        after: Position | None = None,
        parent: str | None = None,
    ) -> tuple[builtins.list[WorkflowRow], Position | None]:
        """Return up to `limit` workflows after `after`, newest first, and where to go on."""
        sql, params = schema.list_query(status, name, after, parent)
        rows = await self._read(sql, [*params, limit + 1], on=self._lister)
        more = len(rows) > limit
        rows = rows[:limit]
        position = (rows[-1][-2], rows[-1][-1]) if more else None
        return [WorkflowRow(*r[:-2]) for r in rows], position

    async def unfinished(self, *, page: int = 1000) -> AsyncIterator[WorkflowRow]:
        """Yield every workflow not in a final status, reading `page` rows at a time."""
        after = ""
        while True:
            rows = await self._read(
                f"SELECT {schema.COLS} FROM workflows WHERE status NOT IN (?, ?, ?) AND id > ?"
                " ORDER BY id LIMIT ?",
                (*FINAL, after, page),
            )
            for r in rows:
                yield WorkflowRow(*r)
            if len(rows) < page:
                return
            after = rows[-1][0]

    async def ended_with_teardown_errors(self) -> builtins.list[WorkflowRow]:
        """Return the ended workflows that still hold a wait whose teardown failed."""
        rows = await self._read(
            f"SELECT {schema.COLS} FROM workflows WHERE status IN (?, ?, ?)"
            " AND state LIKE '%\"TeardownError\"%'",
            FINAL,
        )
        return [WorkflowRow(*r) for r in rows]

    async def history(self, workflow_id: str, *, limit: int = 1000) -> builtins.list[HistoryRow]:
        """Return the workflow's newest `limit` history entries, oldest first."""
        rows = await self._read(
            "SELECT id, workflow_id, at, kind, detail FROM history WHERE workflow_id = ?"
            " ORDER BY seq DESC LIMIT ?",
            (workflow_id, limit),
        )
        return [HistoryRow(i, w, at, k, schema.detail_of(d)) for i, w, at, k, d in reversed(rows)]

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
        return await anyio.to_thread.run_sync(schema.backup_file, self.path, dest)

    async def counts(self) -> dict[str, int]:
        """Return how many workflows are in each status."""
        rows = await self._read("SELECT status, COUNT(*) FROM workflows GROUP BY status")
        return {status: n for status, n in rows}

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

        An existing id is left as is and its schedule still advances; True where inserted.
        The records' `at` is stamped inside the transaction: when the fire was committed.
        """
        clock = get_clock()
        now = clock.now()
        work = []
        for f in fires:
            row = f.row
            entries = [(now, kind, schema.to_json(detail)) for kind, detail in f.history]
            params = (
                row.id, row.name, row.status, row.data, row.state, row.error, row.attempt,
                row.next_run_at, row.created_at or now, row.updated_at or now, row.parent,
                row.deadline, len(entries),
            )  # fmt: skip
            sets: dict[str, Any] = {"last_workflow_id": row.id, "last_fire_at": now}
            if f.last_nominal is not None:
                sets["last_nominal"] = f.last_nominal
            if f.clear_buffered:
                sets["buffered"] = None
            work.append((f, params, entries, sets))

        def apply(conn: sqlite3.Connection) -> builtins.list[bool]:
            stamp = clock.now()
            ids = [f.row.id for f, *_ in work]
            existing = {
                r[0] for r in _in_chunks(conn, "SELECT id FROM workflows WHERE id IN ({})", ids)
            }
            created = [wid not in existing for wid in ids]
            conn.executemany(
                schema.INSERT_WORKFLOW,
                [w[1] for w, made in zip(work, created, strict=True) if made],
            )
            conn.executemany(
                schema.INSERT_HISTORY,
                [
                    (f.row.id, i + 1, *e)
                    for (f, _, entries, _), made in zip(work, created, strict=True)
                    if made
                    for i, e in enumerate(entries)
                ],
            )
            # One UPDATE statement for each set of columns (a batch mostly has one).
            updates: dict[tuple[str, ...], builtins.list[tuple[Any, ...]]] = {}
            for f, _, _, sets in work:
                updates.setdefault(tuple(sets), []).append((*sets.values(), len(f.records), f.name))
            for columns, rows in updates.items():
                conn.executemany(_advance_sql(columns), rows)
            names = [f.name for f, *_ in work]
            sql = "SELECT name, fire_seq FROM schedules WHERE name IN ({})"
            seqs = dict(_in_chunks(conn, sql, names))
            fired, trims = [], []
            for f, *_ in work:
                last = seqs.get(f.name)
                if last is None:
                    raise ScheduleNotFound(f"no schedule {f.name!r}")
                first = last - len(f.records) + 1
                fired += [
                    (f.name, first + i, stamp, r.kind, r.nominal, r.workflow_id, r.reason, r.count)
                    for i, r in enumerate(f.records)
                ]
                if last > schema.FIRES_KEPT and (first - 1) // TRIM_EVERY != last // TRIM_EVERY:
                    trims.append((f.name, last - schema.FIRES_KEPT))
            conn.executemany(schema.INSERT_FIRE, fired)
            conn.executemany(schema.TRIM_FIRES, trims)
            return created

        created: builtins.list[bool] = await self._writes.submit(apply)
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

    async def hooks_pending(self, *, after: int = 0, limit: int = 100) -> builtins.list[HookRow]:
        """Return up to `limit` endings with an id over `after`, oldest first."""
        rows = await self._read(
            "SELECT id, workflow_id, workflow, status, error, at, started_at FROM hook_runs"
            " WHERE id > ? ORDER BY id LIMIT ?",
            (after, limit),
        )
        return [HookRow(*r) for r in rows]

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
        ids = [(i,) for i in hook_ids]
        await self._writes.submit(
            lambda conn: conn.executemany("DELETE FROM hook_runs WHERE id = ?", ids)
        )

    async def counts_by_type(self) -> dict[tuple[str, str], int]:
        """Return how many workflows of each (type, status) there are."""
        rows = await self._read("SELECT name, status, COUNT(*) FROM workflows GROUP BY 1, 2")
        return {(name, status): n for name, status, n in rows}

    async def inbox_depth(self) -> int:
        """Return how many acknowledged events are not yet applied."""
        ((n,),) = await self._read("SELECT COUNT(*) FROM inbox")
        return int(n)


def _in_chunks(conn: sqlite3.Connection, sql: str, keys: Sequence[str]) -> builtins.list[Any]:
    """Run `sql` (its `IN ({})` filled with marks) over `keys`, under SQLite's parameter limit."""
    rows: builtins.list[Any] = []
    for i in range(0, len(keys), 500):
        chunk = keys[i : i + 500]
        rows += conn.execute(sql.format(", ".join("?" * len(chunk))), chunk).fetchall()
    return rows


@functools.cache
def _advance_sql(columns: tuple[str, ...]) -> str:
    """Return the UPDATE that advances a schedule's row: these columns, then `fire_seq`."""
    sets = [f"{c} = MAX({c}, ?)" if c == "last_nominal" else f"{c} = ?" for c in columns]
    return f"UPDATE schedules SET {', '.join([*sets, 'fire_seq = fire_seq + ?'])} WHERE name = ?"
