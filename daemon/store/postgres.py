"""The PostgreSQL store: the SQLite store's contract on a server that several machines can reach."""

from __future__ import annotations

import builtins
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import msgspec
import structlog

from daemon.clock import get_clock
from daemon.errors import ConfigError, ScheduleNotFound, Unavailable, WorkflowNotFound
from daemon.observe.metrics import Metrics
from daemon.store import postgres_schema as schema
from daemon.store.base import (
    Claimed,
    FireRecord,
    History,
    InboxRow,
    ScheduleFire,
    ScheduleRow,
    Taken,
    WorkflowLost,
    WorkflowRow,
)
from daemon.store.postgres_lease import Node, close, connect
from daemon.store.postgres_writer import Conn, PgGroupWriter, broken
from daemon.store.reads import Dialect, Reads
from daemon.store.schema import FINAL, FIRES_KEPT, to_json

log = structlog.get_logger(__name__)
#: A schedule's fire records are trimmed back to FIRES_KEPT each time this many more are added.
TRIM_EVERY = 16
#: Connections for reads (the writer takes one of them per batch).
POOL_SIZE = 8
#: Connections of their own for `list` pages: a flood of them queues behind itself, not in
#: front of the writer, ping's counts or a send's lookups.
LISTER_POOL_SIZE = 2
Entries = Sequence[tuple[float, str, str]]
#: Workflows that ended here whose generation is kept for their last writes.
ENDED_KEPT = 4096
#: How long (at least; two leases if longer) writes of a workflow lost are refused at once.
LOST_HOLD_S = 5.0
#: Lost workflows are forgotten after this long (their copies are long gone).
LOST_FORGET_S = 3600.0
#: The channels LISTEN/NOTIFY wakes daemons on (hints only: sweeps catch what is missed).
WORK, INBOX, REPLY, STATUS = (
    "workflowd_work",
    "workflowd_inbox",
    "workflowd_reply",
    "workflowd_status",
)
NOTIFY_WORK = f"SELECT pg_notify('{WORK}', '')"
NOTIFY_INBOX = f"SELECT pg_notify('{INBOX}', $1)"
INSERT_INBOX = (
    "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at, kind, reply_to,"
    " taken) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING id"
)


class PostgresStore(Reads):
    """Workflows in a PostgreSQL database; one writer task commits every write in groups.

    Several daemons share the database: each holds the leases of the workflows it runs
    (`claim`, `renew`), and every write of a workflow checks the lease's generation, so one
    that lost it (to a daemon that found it expired) writes nothing for it.
    """

    def __init__(
        self,
        where: str,
        pool: asyncpg.Pool,
        keep: int,
        node: Node,
        metrics: Metrics | None = None,
        lister: asyncpg.Pool | None = None,
        *,
        args: dict[str, Any] | None = None,
        pin_timeout_s: float = 300.0,
    ) -> None:
        #: The DSN without its password: what logs and messages name.
        self.where = where
        self.path = Path(where)
        self.node = node
        self.node_id, self.holder = node.node_id, node.holder
        self.pin_timeout_s = pin_timeout_s
        self._args = args or {}
        self._pool = pool
        self._lister = lister or pool
        self._writes = PgGroupWriter(pool, metrics=metrics)
        self.stats = self._writes.stats
        self._keep = keep
        #: The workflows this daemon holds the lease of, and the lease's generation.
        self._owned: dict[str, int] = {}
        #: Workflows that ended here lately, by generation: their last writes (the end is saved
        #: more than once) need no lease, nor a claim each.
        self._ended: OrderedDict[str, int] = OrderedDict()
        #: Workflows whose lease this daemon lost, and when (monotonic): a copy of one still in
        #: memory (a step that was running) must not take it back for its write.
        self._lost: dict[str, float] = {}

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
        pin_timeout_s: float = 300.0,
        metrics: Metrics | None = None,
    ) -> AsyncIterator[PostgresStore]:
        """Connect, migrate, open the pools; on exit drain the writer and hand the leases on."""
        if history_keep < 1:
            raise ConfigError(f"history_keep must be at least 1, not {history_keep}")
        opened = await connect(dsn, passfile=passfile, node_id=node_id, lease_s=lease_s)
        async with contextlib.AsyncExitStack() as stack:
            try:
                pool = await asyncpg.create_pool(**opened.args, min_size=1, max_size=POOL_SIZE)
                stack.push_async_callback(_close_pool, pool)
                lister = await asyncpg.create_pool(
                    **opened.args, min_size=1, max_size=LISTER_POOL_SIZE
                )
                stack.push_async_callback(_close_pool, lister)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
                raise schema.unusable(opened.where, e) from None
            store = cls(
                opened.where, pool, history_keep, opened.node, metrics, lister,
                args=opened.args, pin_timeout_s=pin_timeout_s,
            )  # fmt: skip
            stack.push_async_callback(_goodbye, pool, opened.node)
            failure: Exception | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(store._writes.run)
                try:
                    yield store
                except Exception as e:  # noqa: BLE001 - raised below, outside the task group
                    failure = e
                finally:
                    await store._writes.close()
                    tg.cancel_scope.cancel()
            if failure is not None:
                raise failure

    # -- writes -----------------------------------------------------------------------------

    async def _append(self, conn: Conn, wid: str, last: int, entries: Entries) -> None:
        """Insert history rows numbered up to `last`, then trim the workflow's oldest ones."""
        first = last - len(entries) + 1
        rows = [(wid, first + i, at, kind, detail) for i, (at, kind, detail) in enumerate(entries)]
        await conn.executemany(schema.INSERT_HISTORY, rows)
        if last > self._keep:
            await conn.execute(schema.TRIM_HISTORY, wid, last - self._keep)

    async def _update(
        self,
        wid: str,
        sql: str,
        head: tuple[Any, ...],
        history: History,
        done: Sequence[int] = (),
        *,
        final: bool = False,
    ) -> None:
        """Run a fenced UPDATE ending in `updated_at`, `history_seq`, `id`; append history; drop
        inbox rows. All of it is one statement (schema.fenced): a checkpoint costs one round trip.

        It writes only under this daemon's lease of the workflow: one it does not hold is taken
        first if nobody else holds it (a repair, the janitor); otherwise WorkflowLost.
        """
        lost = self._lost.get(wid)
        if lost is not None:
            if time.monotonic() - lost < max(2 * self.node.lease_s, LOST_HOLD_S):
                raise WorkflowLost(f"another daemon took workflow {wid} over")
            del self._lost[wid]
        now = get_clock().now()
        kinds = [kind for kind, _ in history]
        details = [to_json(detail) for _, detail in history]
        params = (*head, now, len(kinds), wid) if head else (len(kinds), wid)
        extra = (kinds, details, now, self._keep, builtins.list(done))
        # Fenced by the lease held when the write was issued: a write issued under a lease
        # that is lost before it is applied (a pipelined one behind a failed one) must not
        # fall back to claiming the workflow, which takes an ended one from nobody.
        held = self._owned.get(wid) or self._ended.get(wid)

        async def apply(conn: Conn) -> tuple[int, bool | None]:
            generation, taken = held or self._owned.get(wid) or self._ended.get(wid), False
            if generation is None:
                generation = await conn.fetchval(
                    schema.CLAIM_ONE, wid, self.holder, self.node.lease_s
                )
                if generation is None:
                    if await conn.fetchval("SELECT 1 FROM workflows WHERE id = $1", wid) is None:
                        raise WorkflowNotFound(f"no workflow {wid!r}")
                    raise WorkflowLost(f"workflow {wid} is run by another daemon")
                taken = True
            if await conn.fetchval(sql, *params, *extra, generation) is None:
                return generation, None  # another daemon claimed it: nothing was written
            return generation, taken

        generation, taken = await self._writes.submit(apply)
        if taken is None:
            # Unless this daemon claimed the workflow again meanwhile (a newer generation).
            if self._owned.get(wid, generation) == generation:
                self._owned.pop(wid, None)
                self._ended.pop(wid, None)
                self._lost[wid] = time.monotonic()
            if await self.get(wid) is None:
                raise WorkflowNotFound(f"no workflow {wid!r}")
            raise WorkflowLost(f"another daemon took workflow {wid} over")
        if final:
            self._owned.pop(wid, None)  # an ended workflow needs no lease
            self._ended[wid] = generation
            self._ended.move_to_end(wid)
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        else:
            self._ended.pop(wid, None)
            if taken:
                self._owned[wid] = generation

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
            await conn.execute(NOTIFY_WORK)  # delivered at commit: whoever is free claims it
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
        await self._update(
            workflow_id, schema.CHECKPOINT_FENCED, head, history, inbox_done, final=status in FINAL
        )

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
        await self._update(
            workflow_id, schema.SET_STATUS_FENCED, head, history, final=status in FINAL
        )

    async def add_history(self, workflow_id: str, kind: str, detail: dict[str, Any]) -> None:
        """Append one history entry to the workflow."""
        await self._update(workflow_id, schema.ADD_HISTORY_FENCED, (), [(kind, detail)])

    async def inbox_put(
        self, workflow_id: str, event: str, input: Any, *, thread_id: str = "", pc: int = 0
    ) -> int:
        """Record a callback durably and return its inbox id."""
        # Queued by its owner for its own actor: taken already, or the owner would take it twice.
        taken = self.holder if workflow_id in self._owned else None
        params = (workflow_id, event, thread_id, pc, to_json(input), get_clock().now())
        return await self._insert_inbox(params, "callback", None, taken)

    async def _insert_inbox(
        self, params: tuple[Any, ...], kind: str, reply_to: str | None, taken: str | None
    ) -> int:
        async def apply(conn: Conn) -> int:
            inbox_id: int = await conn.fetchval(INSERT_INBOX, *params, kind, reply_to, taken)
            if taken is None:
                await conn.execute(NOTIFY_INBOX, params[0])
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

    #: PostgreSQL's inbox also holds requests (cancels) for a workflow's owner.
    _dialect = Dialect(numbered=True, list_query=schema.list_query, callbacks="kind = 'callback'")

    async def _rows(
        self, sql: str, params: Sequence[Any] = (), *, lister: bool = False
    ) -> builtins.list[Any]:
        return await self._read(sql, *params, on=self._lister if lister else None)

    async def backup(self, dest: Path) -> int:
        """Refuse: a PostgreSQL database is backed up with the server's own tools."""
        raise Unavailable(
            f"the store is PostgreSQL ({self.where}): back it up with pg_dump"
            " (consistent while workflowd runs) or the server's base backups, not workflowctl"
        )

    async def nodes(self) -> builtins.list[dict[str, Any]]:
        """Return the daemons seen within a lease on this database (`ping`), the leader marked."""
        if self._writes.closed:
            raise Unavailable("the store is closed")
        async with self._pool.acquire() as conn:
            return await self.node.nodes(conn)

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
            if created:
                await conn.execute(NOTIFY_WORK)
            # Another daemon fired this nominal time first: it recorded the fire.
            await self._advance(conn, name, sets, records if created else ())
            return created

        created: bool = await self._writes.submit(apply)
        return created

    async def schedule_fire_many(self, fires: Sequence[ScheduleFire]) -> builtins.list[bool]:
        """Insert each fire's workflow and advance its schedule, all in one transaction.

        An existing id is left as is and its schedule still advances, with no records: the
        id is the fire's unique key, so another daemon fired that time first and recorded it.
        True where inserted (of two fires of one id, the first). The records' `at` is stamped
        inside the transaction: when the fire was committed. A batch is a few statements over
        arrays (`unnest`), not a few per fire.
        """
        clock = get_clock()
        now = clock.now()
        rows = [self._insert_params(f.row, len(f.history), now) for f in fires]
        columns: builtins.list[builtins.list[Any]] = [
            builtins.list(c) for c in zip(*rows, strict=True)
        ]
        history = [
            [
                (f.row.id, i + 1, now, kind, to_json(detail))
                for i, (kind, detail) in enumerate(f.history)
            ]
            for f in fires
        ]

        async def apply(conn: Conn) -> builtins.list[bool]:
            stamp = clock.now()
            made = {r[0] for r in await conn.fetch(_INSERT_WORKFLOWS, *columns)}
            created = []
            for f in fires:  # of two fires of one id, the first inserted it
                created.append(f.row.id in made)
                made.discard(f.row.id)
            new = [h for rows, c in zip(history, created, strict=True) if c for h in rows]
            if new:
                await conn.execute(_INSERT_HISTORIES, *map(builtins.list, zip(*new, strict=True)))
                await conn.execute(NOTIFY_WORK)
            records = [f.records if c else () for f, c in zip(fires, created, strict=True)]
            advance = (
                [f.name for f in fires],
                [f.row.id for f in fires],
                [f.last_nominal for f in fires],
                [f.clear_buffered for f in fires],
                [len(r) for r in records],
            )
            seqs = {r[0]: r[1] for r in await conn.fetch(_ADVANCE_MANY, *advance, now)}
            fired, trims = [], []
            for f, kept in zip(fires, records, strict=True):
                last = seqs.get(f.name)
                if last is None:
                    raise ScheduleNotFound(f"no schedule {f.name!r}")
                first = last - len(kept) + 1
                fired += [
                    (f.name, first + i, stamp, r.kind, r.nominal, r.workflow_id, r.reason, r.count)
                    for i, r in enumerate(kept)
                ]
                if last > FIRES_KEPT and (first - 1) // TRIM_EVERY != last // TRIM_EVERY:
                    trims.append((f.name, last - FIRES_KEPT))
            if fired:
                await conn.execute(_INSERT_FIRES, *map(builtins.list, zip(*fired, strict=True)))
            if trims:
                await conn.execute(_TRIM_MANY, *map(builtins.list, zip(*trims, strict=True)))
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

    # -- sharing the work with the other daemons (daemon.store.base.Shared) ----------------

    def owns(self, workflow_id: str) -> bool:
        """Tell whether this daemon holds the workflow's lease, as of its last claim or renewal."""
        return workflow_id in self._owned

    def leads(self) -> bool:
        """Tell whether this daemon held the leader row at its last renewal."""
        return self.node.leader

    def drop(self, workflow_id: str) -> None:
        """Forget a workflow's lease: its writes from now on must take it again first."""
        self._owned.pop(workflow_id, None)

    async def claim(self, limit: int) -> Claimed:
        """Take the leases of up to `limit` unfinished workflows nobody holds, in one short
        transaction (FOR UPDATE SKIP LOCKED), with every inbox row they have."""
        if self._writes.closed:
            raise Unavailable("the store is closed")
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                schema.CLAIM, self.holder, self.node_id, limit, self.node.lease_s,
                self.pin_timeout_s,
            )  # fmt: skip
            ids = [r[0] for r in rows]
            inbox = await conn.fetch(schema.TAKE_CLAIMED, self.holder, ids) if ids else []
            expiry = await conn.fetchval(schema.NEXT_EXPIRY, self.holder)
        claimed = []
        for r in rows:
            self._owned[r[0]] = r[-2]
            self._lost.pop(r[0], None)
            claimed.append(WorkflowRow(*r[:-2]))
        moved = [r[0] for r in rows if r[-1] is not None and r[-1] != self.node_id]
        return Claimed(claimed, _taken(inbox), moved, None if expiry is None else float(expiry))

    async def renew(self) -> builtins.list[str]:
        """Extend every lease this daemon holds and note it alive; return the workflows lost."""
        held = dict(self._owned)
        async with self._pool.acquire() as conn:
            kept = {
                r[0]
                for r in await conn.fetch(
                    schema.RENEW, self.holder, self.node.lease_s, builtins.list(held),
                    builtins.list(held.values()),
                )
            }  # fmt: skip
            await self.node.beat(conn)
        # One claimed again meanwhile (a newer generation) is not lost.
        lost = [w for w, g in held.items() if w not in kept and self._owned.get(w) == g]
        at = time.monotonic()
        for wid in lost:
            self._owned.pop(wid, None)
            self._lost[wid] = at
        for wid in [w for w, t in self._lost.items() if at - t > LOST_FORGET_S]:
            del self._lost[wid]
        return lost

    async def take_inbox(self) -> builtins.list[Taken]:
        """Take the inbox rows nobody took yet of the workflows this daemon holds."""
        if not self._owned:
            return []
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(schema.TAKE_NEW, self.holder)
        return [t for t in _taken(rows) if t.row.workflow_id in self._owned]

    async def request(
        self,
        workflow_id: str,
        kind: str,
        event: str,
        input: Any,
        *,
        thread_id: str = "",
        pc: int = 0,
        reply: bool = False,
    ) -> int:
        """Store a callback or a cancel for the workflow's owner, durably, and wake it."""
        params = (workflow_id, event, thread_id, pc, to_json(input), get_clock().now())
        return await self._insert_inbox(params, kind, self.holder if reply else None, None)

    async def answer(
        self, inbox_id: int, reply_to: str, ok: bool, value: Any, *, done: bool
    ) -> None:
        """Store the answer to a request for the daemon that waits for it, and wake that one."""
        now = get_clock().now()

        async def apply(conn: Conn) -> None:
            await conn.execute(
                "INSERT INTO replies (inbox_id, reply_to, ok, value, at) VALUES ($1, $2, $3, $4, $5)"
                " ON CONFLICT (inbox_id) DO UPDATE SET ok = $3, value = $4, at = $5",
                inbox_id, reply_to, ok, to_json(value), now,
            )  # fmt: skip
            if done:
                await conn.execute(schema.DELETE_INBOX, [inbox_id])
            await conn.execute(f"SELECT pg_notify('{REPLY}', $1)", reply_to)

        await self._writes.submit(apply)

    async def answers(self) -> builtins.list[tuple[int, bool, Any]]:
        """Take the answers stored for this daemon: (inbox id, ok, value or error)."""
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                "DELETE FROM replies WHERE reply_to = $1 RETURNING inbox_id, ok, value",
                self.holder,
            )
        return [(i, ok, msgspec.json.decode(v)) for i, ok, v in rows]

    async def owner_of(self, workflow_id: str) -> str | None:
        """Return the node_id of the daemon holding the workflow's lease, if any."""
        rows = await self._read(schema.OWNER_OF, workflow_id)
        return rows[0][0] if rows else None

    async def pin(self, pin: Sequence[str], unpin: Sequence[str]) -> None:
        """Pin workflows held here to this node, or unpin them (under their leases' generation)."""
        pairs = [(w, self.node_id) for w in pin] + [(w, None) for w in unpin]
        held = [(w, n, self._owned[w]) for w, n in pairs if w in self._owned]
        if not held:
            return
        ids, nodes, generations = (builtins.list(x) for x in zip(*held, strict=True))

        async def apply(conn: Conn) -> None:
            await conn.execute(
                "UPDATE workflows w SET pin_node = t.node"
                " FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(id, node, g)"
                " WHERE w.id = t.id AND w.generation = t.g",
                ids, nodes, generations,
            )  # fmt: skip

        await self._writes.submit(apply)

    async def listen(self, wake: Callable[[str, str], None]) -> None:
        """Call `wake(channel, payload)` for each notification, until cancelled.

        A lost connection is opened again; `wake("connected", "")` after each (re)connect
        tells the caller to sweep for what it may have missed meanwhile.
        """
        backoff = 0.5
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(**self._args)
                gone = anyio.Event()
                conn.add_termination_listener(lambda _conn, gone=gone: gone.set())

                def heard(_conn: Any, _pid: int, channel: str, payload: object) -> None:
                    wake(channel, str(payload))

                for channel in (WORK, INBOX, REPLY, STATUS):
                    await conn.add_listener(channel, heard)
                wake("connected", "")
                backoff = 0.5
                while not conn.is_closed():
                    with anyio.move_on_after(max(self.node.lease_s / 3, 0.5)):
                        await gone.wait()
                    if not conn.is_closed():
                        await conn.execute("SELECT 1")  # a server that vanished is noticed
            except Exception as e:  # noqa: BLE001 - retried: notifications are only hints
                log.warning("listen_failed", error=f"{type(e).__name__}: {e}", retry_in_s=backoff)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await close(conn)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


def _taken(rows: Sequence[asyncpg.Record]) -> builtins.list[Taken]:
    """Turn taken inbox rows into Taken, oldest first; a row that does not decode is logged."""
    out = []
    for i, w, e, t, pc, x, at, kind, reply_to in sorted(rows, key=lambda r: r[0]):
        try:
            out.append(Taken(InboxRow(i, w, e, t, pc, msgspec.json.decode(x), at), kind, reply_to))
        except msgspec.DecodeError as err:  # one bad row must not stop the others
            log.error("inbox_corrupt", inbox_id=i, workflow_id=w, event_name=e, error=str(err))
    return out


async def _close_pool(pool: asyncpg.Pool) -> None:
    with anyio.CancelScope(shield=True):
        await pool.close()


async def _goodbye(pool: asyncpg.Pool, node: Node) -> None:
    """Hand the leases on at a clean stop (the writer is closed: nothing more is written)."""
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        async with pool.acquire() as conn:
            await node.goodbye(conn)


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
