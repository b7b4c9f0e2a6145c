"""The PostgreSQL store: the SQLite store's contract on a server that several machines can reach."""

from __future__ import annotations

import builtins
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import msgspec
import structlog

from daemon.clock import get_clock
from daemon.errors import ConfigError, ScheduleNotFound, Unavailable, WorkflowNotFound
from daemon.observe.hooks import HookRow
from daemon.observe.metrics import Metrics
from daemon.store import postgres_schema as schema
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
from daemon.store.postgres_lease import Claim, Lease, LeaseLost, close, holder_name
from daemon.store.postgres_lease import claim as claim_database
from daemon.store.postgres_writer import Conn, PgGroupWriter, broken
from daemon.store.schema import FINAL, FIRES_KEPT, detail_of, to_json

log = structlog.get_logger(__name__)
#: A schedule's fire records are trimmed back to FIRES_KEPT each time this many more are added.
TRIM_EVERY = 16
#: Connections for reads (the writer takes one of them per batch).
POOL_SIZE = 8
#: Connections of their own for `list` pages: a flood of them queues behind itself, not in
#: front of the writer, ping's counts or a send's lookups.
LISTER_POOL_SIZE = 2
#: Where `updated_at` is in a row of schema.COLS (a list page's position is made of it).
UPDATED_AT = [c.strip() for c in schema.COLS.split(",")].index("updated_at")
Entries = Sequence[tuple[float, str, str]]


class PostgresStore:
    """Workflows in a PostgreSQL database; one writer task commits every write in groups."""

    def __init__(
        self,
        where: str,
        pool: asyncpg.Pool,
        keep: int,
        lease: Lease,
        metrics: Metrics | None = None,
        lister: asyncpg.Pool | None = None,
    ) -> None:
        #: The DSN without its password: what logs and messages name.
        self.where = where
        self.path = Path(where)
        self.lease = lease
        self._pool = pool
        self._lister = lister or pool
        self._writes = PgGroupWriter(pool, fence=lease.fence, metrics=metrics)
        self.stats = self._writes.stats
        self._keep = keep

    #: Connect, migrate, and wait as a standby until this daemon holds the database's lease.
    claim = staticmethod(claim_database)

    @classmethod
    @contextlib.asynccontextmanager
    async def reader(
        cls, dsn: str, *, passfile: Path | None = None, node_id: str = "", lease_s: float = 15.0
    ) -> AsyncIterator[PostgresStore]:
        """Open the database for reads only (a standby's view); it writes nothing."""
        node_id = node_id or socket.gethostname()
        lease = Lease(holder_name(node_id), node_id, lease_s, lost=True)  # never held: no writes
        args = schema.connect_args(dsn, passfile, lease.holder)
        pool = await asyncpg.create_pool(**args, min_size=1, max_size=2)
        try:
            yield cls(schema.redact(dsn), pool, 1, lease)
        finally:
            await _close_pool(pool)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        dsn: str,
        *,
        passfile: Path | None = None,
        history_keep: int = 1000,
        node_id: str = "",
        lease_s: float = 15.0,
        claim: Claim | None = None,
        metrics: Metrics | None = None,
    ) -> AsyncIterator[PostgresStore]:
        """Claim the database (unless `claim` did), open a pool; drain, release, disconnect on exit.

        When the lease is lost (another daemon took over) the block is cancelled, nothing
        more is written, and LeaseLost is raised.
        """
        if history_keep < 1:
            raise ConfigError(f"history_keep must be at least 1, not {history_keep}")
        if claim is None:
            claim = await cls.claim(dsn, passfile=passfile, node_id=node_id, lease_s=lease_s)
        lease = claim.lease
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(close, claim.conn)
            stack.push_async_callback(_release, claim.conn, lease)
            try:
                pool = await asyncpg.create_pool(**claim.args, min_size=1, max_size=POOL_SIZE)
                stack.push_async_callback(_close_pool, pool)
                lister = await asyncpg.create_pool(
                    **claim.args, min_size=1, max_size=LISTER_POOL_SIZE
                )
                stack.push_async_callback(_close_pool, lister)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
                raise schema.unusable(claim.where, e) from None
            store = cls(claim.where, pool, history_keep, lease, metrics, lister)
            failure: Exception | None = None
            async with anyio.create_task_group() as tg:

                async def keep() -> None:
                    with contextlib.suppress(LeaseLost):
                        await lease.keep(pool)
                    tg.cancel_scope.cancel()  # the daemon on top stops; its writes are fenced

                tg.start_soon(store._writes.run)
                tg.start_soon(keep)
                try:
                    yield store
                except Exception as e:  # noqa: BLE001 - raised below, outside the task group
                    failure = e
                finally:
                    await store._writes.close()
                    tg.cancel_scope.cancel()
            if failure is not None:
                raise failure
            if lease.lost:
                raise LeaseLost(f"another workflowd took {claim.where} over")

    # -- writes -----------------------------------------------------------------------------

    async def _append(self, conn: Conn, wid: str, last: int, entries: Entries) -> None:
        """Insert history rows numbered up to `last`, then trim the workflow's oldest ones."""
        first = last - len(entries) + 1
        rows = [(wid, first + i, at, kind, detail) for i, (at, kind, detail) in enumerate(entries)]
        await conn.executemany(schema.INSERT_HISTORY, rows)
        if last > self._keep:
            await conn.execute(schema.TRIM_HISTORY, wid, last - self._keep)

    async def _update(
        self, wid: str, sql: str, head: tuple[Any, ...], history: History, done: Sequence[int] = ()
    ) -> None:
        """Run an UPDATE ending in `updated_at`, `history_seq`, `id`; append history; drop inbox rows.

        All of it is one statement (schema.with_history): a checkpoint costs one round trip.
        """
        now = get_clock().now()
        kinds = [kind for kind, _ in history]
        details = [to_json(detail) for _, detail in history]
        params = (*head, now, len(kinds), wid) if head else (len(kinds), wid)
        extra = (kinds, details, now, self._keep, builtins.list(done))

        async def apply(conn: Conn) -> None:
            if await conn.fetchval(sql, *params, *extra) is None:
                raise WorkflowNotFound(f"no workflow {wid!r}")

        await self._writes.submit(apply)

    def _insert_params(self, row: WorkflowRow, n_entries: int, now: float) -> tuple[Any, ...]:
        return (
            row.id, row.name, row.status, row.data, row.state, row.error, row.attempt,
            row.next_run_at, row.created_at or now, row.updated_at or now, row.parent,
            row.deadline, n_entries,
        )  # fmt: skip

    async def create(self, row: WorkflowRow, history: History = ()) -> bool:
        """Insert `row` unless its id exists; return whether it was inserted, once durable."""
        now = get_clock().now()
        entries = [(now, kind, to_json(detail)) for kind, detail in history]
        params = self._insert_params(row, len(entries), now)

        async def apply(conn: Conn) -> bool:
            if await conn.execute(schema.INSERT_WORKFLOW, *params) != "INSERT 0 1":
                return False
            if entries:
                await self._append(conn, row.id, len(entries), entries)
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
        head = (status, error, attempt, next_run_at)
        await self._update(workflow_id, schema.SET_STATUS, head, history)

    async def add_history(self, workflow_id: str, kind: str, detail: dict[str, Any]) -> None:
        """Append one history entry to the workflow."""
        await self._update(workflow_id, schema.ADD_HISTORY, (), [(kind, detail)])

    async def inbox_put(
        self, workflow_id: str, event: str, input: Any, *, thread_id: str = "", pc: int = 0
    ) -> int:
        """Record a callback durably and return its inbox id."""
        params = (workflow_id, event, thread_id, pc, to_json(input), get_clock().now())

        async def apply(conn: Conn) -> int:
            inbox_id: int = await conn.fetchval(
                "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at)"
                " VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
                *params,
            )
            return inbox_id

        inbox_id: int = await self._writes.submit(apply)
        return inbox_id

    async def inbox_done(self, ids: Sequence[int]) -> None:
        """Drop inbox rows without a checkpoint (for callbacks that were rejected)."""
        done = builtins.list(ids)

        async def apply(conn: Conn) -> None:
            await conn.execute(schema.DELETE_INBOX, done)

        await self._writes.submit(apply)

    async def delete_finished(self, older_than: float) -> int:
        """Delete workflows in a final status not updated since `older_than`; return how many."""
        final = builtins.list(FINAL)
        where = "status = ANY($1::text[]) AND updated_at < $2"

        async def apply(conn: Conn) -> int:
            ids = [
                r[0] for r in await conn.fetch(f"SELECT id FROM workflows WHERE {where}", final,
                                               older_than)
            ]  # fmt: skip
            if not ids:
                return 0
            await conn.execute("DELETE FROM history WHERE workflow_id = ANY($1::text[])", ids)
            await conn.execute("DELETE FROM inbox WHERE workflow_id = ANY($1::text[])", ids)
            status = await conn.execute("DELETE FROM workflows WHERE id = ANY($1::text[])", ids)
            return int(status.split()[-1])

        deleted: int = await self._writes.submit(apply)
        return deleted

    # -- reads ------------------------------------------------------------------------------

    async def _read(
        self, sql: str, *params: Any, on: asyncpg.Pool | None = None
    ) -> builtins.list[asyncpg.Record]:
        if self._writes.closed:
            raise Unavailable("the store is closed")
        pool = on or self._pool
        try:
            rows: builtins.list[asyncpg.Record] = await pool.fetch(sql, *params)
        except Exception as e:
            if not broken(e):
                raise
            # A connection the server dropped (a restart, a failover) is only noticed on use:
            # the pool replaces it, and one more try needs no caller to know.
            rows = await pool.fetch(sql, *params)
        return rows

    async def get(self, workflow_id: str) -> WorkflowRow | None:
        """Return the workflow with that id, or None."""
        rows = await self._read(f"SELECT {schema.COLS} FROM workflows WHERE id = $1", workflow_id)
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
        rows = await self._read(sql, *params, limit + 1, on=self._lister)
        more = len(rows) > limit
        rows = rows[:limit]
        position = (rows[-1][UPDATED_AT], rows[-1][-1]) if more else None
        return [WorkflowRow(*r[:-1]) for r in rows], position

    async def unfinished(self, *, page: int = 1000) -> AsyncIterator[WorkflowRow]:
        """Yield every workflow not in a final status, reading `page` rows at a time."""
        after = ""
        while True:
            rows = await self._read(
                f"SELECT {schema.COLS} FROM workflows WHERE status <> ALL($1::text[])"
                " AND id > $2 ORDER BY id LIMIT $3",
                builtins.list(FINAL),
                after,
                page,
            )
            for r in rows:
                yield WorkflowRow(*r)
            if len(rows) < page:
                return
            after = rows[-1][0]

    async def ended_with_teardown_errors(self) -> builtins.list[WorkflowRow]:
        """Return the ended workflows that still hold a wait whose teardown failed."""
        rows = await self._read(
            f"SELECT {schema.COLS} FROM workflows WHERE status = ANY($1::text[])"
            " AND state LIKE '%\"TeardownError\"%'",
            builtins.list(FINAL),
        )
        return [WorkflowRow(*r) for r in rows]

    async def history(self, workflow_id: str, *, limit: int = 1000) -> builtins.list[HistoryRow]:
        """Return the workflow's newest `limit` history entries, oldest first."""
        rows = await self._read(
            "SELECT id, workflow_id, at, kind, detail FROM history WHERE workflow_id = $1"
            " ORDER BY seq DESC LIMIT $2",
            workflow_id,
            limit,
        )
        return [HistoryRow(i, w, at, k, detail_of(d)) for i, w, at, k, d in reversed(rows)]

    async def inbox_pending(self, workflow_id: str | None = None) -> builtins.list[InboxRow]:
        """Return the callbacks not yet applied (of one workflow, or all), oldest first."""
        rows = await self._read(
            "SELECT id, workflow_id, event, thread_id, pc, input, created_at FROM inbox"
            " WHERE $1::text IS NULL OR workflow_id = $1 ORDER BY id",
            workflow_id,
        )
        out = []
        for i, w, e, t, pc, x, at in rows:
            try:
                out.append(InboxRow(i, w, e, t, pc, msgspec.json.decode(x), at))
            except msgspec.DecodeError as err:  # one bad row must not stop recovery
                log.error("inbox_corrupt", inbox_id=i, workflow_id=w, event_name=e, error=str(err))
        return out

    async def backup(self, dest: Path) -> int:
        """Refuse: a PostgreSQL database is backed up with the server's own tools."""
        raise Unavailable(
            f"the store is PostgreSQL ({self.where}): back it up with pg_dump"
            " (consistent while workflowd runs) or the server's base backups, not workflowctl"
        )

    async def nodes(self) -> builtins.list[dict[str, Any]]:
        """Return the daemons seen lately on this database (`ping`), the lease holder marked."""
        if self._writes.closed:
            raise Unavailable("the store is closed")
        async with self._pool.acquire() as conn:
            return await self.lease.nodes(conn)

    async def counts(self) -> dict[str, int]:
        """Return how many workflows are in each status."""
        rows = await self._read("SELECT status, COUNT(*) FROM workflows GROUP BY status")
        return {status: n for status, n in rows}

    # -- schedules --------------------------------------------------------------------------

    async def schedules_load(self, names: Sequence[str], now: float) -> builtins.list[ScheduleRow]:
        """Return the named schedules' state, adding the new ones as handled up to `now`."""
        wanted = builtins.list(names)

        async def apply(conn: Conn) -> builtins.list[asyncpg.Record]:
            await conn.execute(schema.ADD_SCHEDULES, wanted, now)
            rows: builtins.list[asyncpg.Record] = await conn.fetch(
                f"SELECT {schema.SCHEDULE_COLS} FROM schedules WHERE name = ANY($1::text[])",
                wanted,
            )
            return rows

        rows = await self._writes.submit(apply)
        return [ScheduleRow(n, last, bool(p), b, w, f) for n, last, p, b, w, f in rows]

    async def _advance(
        self,
        conn: Conn,
        name: str,
        sets: dict[str, Any],
        records: Sequence[FireRecord],
    ) -> None:
        """Update a schedule's row, append its records, drop the oldest ones."""
        columns = [
            f"{c} = GREATEST({c}, ${i})" if c == "last_nominal" else f"{c} = ${i}"
            for i, c in enumerate(sets, start=1)
        ]
        n = len(sets)
        sql = (
            f"UPDATE schedules SET {', '.join([*columns, f'fire_seq = fire_seq + ${n + 1}'])}"
            f" WHERE name = ${n + 2} RETURNING fire_seq"
        )
        seq = await conn.fetchval(sql, *sets.values(), len(records), name)
        if seq is None:
            raise ScheduleNotFound(f"no schedule {name!r}")
        first = seq - len(records) + 1
        if records:
            await conn.executemany(
                schema.INSERT_FIRE,
                [
                    (name, first + i, r.at, r.kind, r.nominal, r.workflow_id, r.reason, r.count)
                    for i, r in enumerate(records)
                ],
            )
        if seq > FIRES_KEPT and (first - 1) // TRIM_EVERY != seq // TRIM_EVERY:
            await conn.execute(schema.TRIM_FIRES, name, seq - FIRES_KEPT)

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
        """Insert the workflow and advance its schedule in one transaction; True if inserted.

        The workflow id is the fire's unique key: two daemons firing one nominal time create
        one workflow.
        """
        now = get_clock().now()
        entries = [(now, kind, to_json(detail)) for kind, detail in history]
        params = self._insert_params(row, len(entries), now)
        sets: dict[str, Any] = {"last_workflow_id": row.id, "last_fire_at": now}
        if last_nominal is not None:
            sets["last_nominal"] = last_nominal
        if clear_buffered:
            sets["buffered"] = None

        async def apply(conn: Conn) -> bool:
            created = await conn.execute(schema.INSERT_WORKFLOW, *params) == "INSERT 0 1"
            if created and entries:
                await self._append(conn, row.id, len(entries), entries)
            await self._advance(conn, name, sets, records)
            return created

        created: bool = await self._writes.submit(apply)
        return created

    async def schedule_fire_many(self, fires: Sequence[ScheduleFire]) -> builtins.list[bool]:
        """Insert each fire's workflow and advance its schedule, all in one transaction.

        An existing id is left as is and its schedule still advances; True where inserted.
        The records' `at` is stamped inside the transaction: when the fire was committed.
        A batch is a few statements over arrays (`unnest`), not a few per fire.
        """
        clock = get_clock()
        now = clock.now()
        rows = [self._insert_params(f.row, len(f.history), now) for f in fires]
        columns: builtins.list[builtins.list[Any]] = [
            builtins.list(c) for c in zip(*rows, strict=True)
        ]
        history = [
            (f.row.id, i + 1, now, kind, to_json(detail))
            for f in fires
            for i, (kind, detail) in enumerate(f.history)
        ]
        advance = (
            [f.name for f in fires],
            [f.row.id for f in fires],
            [f.last_nominal for f in fires],
            [f.clear_buffered for f in fires],
            [len(f.records) for f in fires],
        )

        async def apply(conn: Conn) -> builtins.list[bool]:
            stamp = clock.now()
            made = {r[0] for r in await conn.fetch(_INSERT_WORKFLOWS, *columns)}
            new = [h for h in history if h[0] in made]
            if new:
                await conn.execute(_INSERT_HISTORIES, *map(builtins.list, zip(*new, strict=True)))
            seqs = {r[0]: r[1] for r in await conn.fetch(_ADVANCE_MANY, *advance, now)}
            fired, trims = [], []
            for f in fires:
                last = seqs.get(f.name)
                if last is None:
                    raise ScheduleNotFound(f"no schedule {f.name!r}")
                first = last - len(f.records) + 1
                fired += [
                    (f.name, first + i, stamp, r.kind, r.nominal, r.workflow_id, r.reason, r.count)
                    for i, r in enumerate(f.records)
                ]
                if last > FIRES_KEPT and (first - 1) // TRIM_EVERY != last // TRIM_EVERY:
                    trims.append((f.name, last - FIRES_KEPT))
            if fired:
                await conn.execute(_INSERT_FIRES, *map(builtins.list, zip(*fired, strict=True)))
            if trims:
                await conn.execute(_TRIM_MANY, *map(builtins.list, zip(*trims, strict=True)))
            return [f.row.id in made for f in fires]

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
            sets["paused"] = paused
        if buffered is not None:
            sets["buffered"] = buffered

        async def apply(conn: Conn) -> None:
            await self._advance(conn, name, sets, records)

        await self._writes.submit(apply)

    async def schedule_fires(self, name: str, *, limit: int = 100) -> builtins.list[FireRecord]:
        """Return a schedule's newest `limit` kept fires and skips, oldest first."""
        rows = await self._read(
            "SELECT at, kind, nominal, workflow_id, reason, count FROM schedule_fires"
            " WHERE schedule = $1 ORDER BY seq DESC LIMIT $2",
            name,
            limit,
        )
        return [FireRecord(*r) for r in reversed(rows)]

    # -- hooks and gauges -------------------------------------------------------------------

    async def hooks_pending(self, *, after: int = 0, limit: int = 100) -> builtins.list[HookRow]:
        """Return up to `limit` endings with an id over `after`, oldest first."""
        rows = await self._read(
            "SELECT id, workflow_id, workflow, status, error, at, started_at FROM hook_runs"
            " WHERE id > $1 ORDER BY id LIMIT $2",
            after,
            limit,
        )
        return [HookRow(*r) for r in rows]

    async def hook_claim(self, hook_id: int) -> None:
        """Mark an ending's hook as started, durably, before it runs."""
        now = get_clock().now()

        async def apply(conn: Conn) -> None:
            await conn.execute("UPDATE hook_runs SET started_at = $1 WHERE id = $2", now, hook_id)

        await self._writes.submit(apply)

    async def hooks_done(self, hook_ids: Sequence[int]) -> None:
        """Forget endings whose hooks ran (or that have none)."""
        ids = builtins.list(hook_ids)

        async def apply(conn: Conn) -> None:
            await conn.execute("DELETE FROM hook_runs WHERE id = ANY($1::bigint[])", ids)

        await self._writes.submit(apply)

    async def counts_by_type(self) -> dict[tuple[str, str], int]:
        """Return how many workflows of each (type, status) there are."""
        rows = await self._read("SELECT name, status, COUNT(*) FROM workflows GROUP BY 1, 2")
        return {(name, status): n for name, status, n in rows}

    async def inbox_depth(self) -> int:
        """Return how many acknowledged events are not yet applied."""
        rows = await self._read("SELECT COUNT(*) FROM inbox")
        return int(rows[0][0])


async def _close_pool(pool: asyncpg.Pool) -> None:
    with anyio.CancelScope(shield=True):
        await pool.close()


async def _release(conn: Conn, lease: Lease) -> None:
    """Hand the lease on at a clean stop; a connection gone already has released it too."""
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await lease.release(conn)


# -- schedules: many fires, each statement over arrays ----------------------------------------

_INSERT_WORKFLOWS = (
    f"INSERT INTO workflows ({schema.COLS}, history_seq)"
    " SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],"
    " $6::text[], $7::int[], $8::float8[], $9::float8[], $10::float8[], $11::text[],"
    " $12::float8[], $13::bigint[])"
    " ON CONFLICT (id) DO NOTHING RETURNING id"
)
_INSERT_HISTORIES = (
    "INSERT INTO history (workflow_id, seq, at, kind, detail)"
    " SELECT * FROM unnest($1::text[], $2::bigint[], $3::float8[], $4::text[], $5::text[])"
)
#: As `_advance` does for one: the newest `last_nominal` wins, `fire_seq` counts the records.
_ADVANCE_MANY = """
    UPDATE schedules AS s SET
        last_workflow_id = u.wid, last_fire_at = $6,
        last_nominal = GREATEST(s.last_nominal, COALESCE(u.nominal, s.last_nominal)),
        buffered = CASE WHEN u.clear THEN NULL ELSE s.buffered END,
        fire_seq = s.fire_seq + u.n
    FROM unnest($1::text[], $2::text[], $3::float8[], $4::bool[], $5::int[])
        AS u(name, wid, nominal, clear, n)
    WHERE s.name = u.name
    RETURNING s.name, s.fire_seq
"""
_INSERT_FIRES = (
    "INSERT INTO schedule_fires (schedule, seq, at, kind, nominal, workflow_id, reason, count)"
    " SELECT * FROM unnest($1::text[], $2::bigint[], $3::float8[], $4::text[], $5::float8[],"
    " $6::text[], $7::text[], $8::int[])"
)
_TRIM_MANY = (
    "DELETE FROM schedule_fires AS f USING unnest($1::text[], $2::bigint[]) AS t(name, upto)"
    " WHERE f.schedule = t.name AND f.seq <= t.upto"
)
