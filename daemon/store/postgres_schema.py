"""The PostgreSQL database: migrations under an advisory lock, SQL text, DSN checks, connecting."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from daemon.errors import ConfigError, StoreUnusable
from daemon.store.schema import FINAL

#: The advisory lock key (pg_advisory_xact_lock) migrations run under.
MIGRATE_LOCK = 0x77666D69  # "wfmi"
COLS = (
    "id, name, status, data, state, error, attempt, next_run_at, created_at, updated_at,"
    " parent, deadline"
)

#: The partial indexes' condition: a workflow that has not ended (schema.FINAL, spelled out
#: because an index predicate takes no parameters).
UNFINISHED = "status NOT IN (" + ", ".join(f"'{s}'" for s in FINAL) + ")"

#: MIGRATIONS[n] takes the schema from version n to n + 1; append new ones, never edit old ones.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE workflows (
        -- "C": ids page in byte order, as SQLite's do, on the primary key's own index
        id TEXT COLLATE "C" PRIMARY KEY, name TEXT NOT NULL, status TEXT NOT NULL,
        data TEXT NOT NULL, state TEXT NOT NULL, error TEXT,
        attempt INTEGER NOT NULL DEFAULT 0, next_run_at DOUBLE PRECISION,
        created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
        history_seq BIGINT NOT NULL DEFAULT 0
    );
    CREATE INDEX workflows_status ON workflows (status);
    CREATE INDEX workflows_updated ON workflows (updated_at);
    CREATE TABLE history (
        id BIGSERIAL PRIMARY KEY, workflow_id TEXT NOT NULL, seq BIGINT NOT NULL,
        at DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL
    );
    CREATE INDEX history_workflow ON history (workflow_id, seq);
    CREATE TABLE inbox (
        id BIGSERIAL PRIMARY KEY, workflow_id TEXT NOT NULL, event TEXT NOT NULL,
        thread_id TEXT NOT NULL, pc BIGINT NOT NULL, input TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX inbox_workflow ON inbox (workflow_id);
    CREATE TABLE schedules (
        name TEXT PRIMARY KEY, last_nominal DOUBLE PRECISION NOT NULL,
        paused BOOLEAN NOT NULL DEFAULT FALSE, buffered DOUBLE PRECISION,
        last_workflow_id TEXT, last_fire_at DOUBLE PRECISION,
        fire_seq BIGINT NOT NULL DEFAULT 0, created_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE schedule_fires (
        schedule TEXT NOT NULL, seq BIGINT NOT NULL, at DOUBLE PRECISION NOT NULL,
        kind TEXT NOT NULL, nominal DOUBLE PRECISION, workflow_id TEXT, reason TEXT,
        count INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (schedule, seq)
    )
    """,
    """
    -- the database lease (daemon.store.postgres_lease): who writes, until when, which term
    CREATE TABLE leases (
        name TEXT PRIMARY KEY, holder TEXT NOT NULL, node_id TEXT NOT NULL,
        until DOUBLE PRECISION NOT NULL, generation BIGINT NOT NULL
    )
    """,
    """
    -- every daemon on the database, holder or standby, notes itself here (`ping` lists them)
    CREATE TABLE nodes (
        holder TEXT PRIMARY KEY, node_id TEXT NOT NULL, seen_at DOUBLE PRECISION NOT NULL
    )
    """,
    # Hooks: the end of a workflow (Failed, Finished) queues one row in the transaction that
    # commits it, so a crash can neither lose it nor (with `started_at`) run its hook twice.
    # Only the lease holder writes, one transaction at a time: ids commit in their order.
    """
    CREATE TABLE hook_runs (
        id BIGSERIAL PRIMARY KEY,  -- the key of one ending: never reused
        workflow_id TEXT NOT NULL, workflow TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
        at DOUBLE PRECISION NOT NULL,
        started_at DOUBLE PRECISION  -- committed before the hook runs: never run again
    );
    CREATE FUNCTION workflowd_hook_on_end() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO hook_runs (workflow_id, workflow, status, error, at)
        VALUES (NEW.id, NEW.name, NEW.status, NEW.error, NEW.updated_at);
        RETURN NULL;
    END
    $$;
    CREATE TRIGGER hook_on_end AFTER UPDATE OF status ON workflows FOR EACH ROW
    WHEN (NEW.status IN ('Failed', 'Finished') AND NEW.status IS DISTINCT FROM OLD.status)
    EXECUTE FUNCTION workflowd_hook_on_end()
    """,
    # Child workflows and deadlines (issue 19): who started a workflow, and when it is cancelled.
    """
    ALTER TABLE workflows ADD COLUMN parent TEXT,  -- the workflow whose Child case started it
        ADD COLUMN deadline DOUBLE PRECISION  -- epoch seconds: cancelled past it (timeout_s)
    """,
    # `list` pages newest first by (updated_at, rid), filtered by status, type, parent or none:
    # each filter reads its own index in order, with no sort. `rid` is SQLite's rowid here: a
    # stable tie-break for rows changed at the same time (existing rows get one each).
    """
    ALTER TABLE workflows ADD COLUMN rid BIGINT GENERATED ALWAYS AS IDENTITY;
    DROP INDEX workflows_updated;
    DROP INDEX workflows_status;
    CREATE INDEX workflows_updated ON workflows (updated_at, rid);
    CREATE INDEX workflows_status_updated ON workflows (status, updated_at, rid);
    CREATE INDEX workflows_name_updated ON workflows (name, updated_at, rid);
    CREATE INDEX workflows_parent ON workflows (parent, updated_at, rid) WHERE parent IS NOT NULL
    """,
    # Several daemons sharing the work (issue 18): each unfinished workflow is owned by one
    # daemon (`owner`, its connections' application_name) until `lease_until` (server time);
    # every claim bumps `generation`, and every write checks it. `pin_node` is the node_id a
    # FileWatch or SocketListen wait was set up on. Inbox rows say what they ask (`kind`), who
    # waits for the answer (`reply_to`) and which owner took them (`taken`); `replies` holds
    # the answers until the daemon that received the request reads them.
    f"""
    ALTER TABLE workflows ADD COLUMN owner TEXT,
        ADD COLUMN lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
        ADD COLUMN generation BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN pin_node TEXT;
    CREATE INDEX workflows_claimable ON workflows (lease_until) WHERE {UNFINISHED};
    CREATE INDEX workflows_owner ON workflows (owner) WHERE {UNFINISHED};
    ALTER TABLE inbox ADD COLUMN kind TEXT NOT NULL DEFAULT 'callback',
        ADD COLUMN reply_to TEXT, ADD COLUMN taken TEXT;
    CREATE TABLE replies (
        inbox_id BIGINT PRIMARY KEY, reply_to TEXT NOT NULL, ok BOOLEAN NOT NULL,
        value TEXT NOT NULL, at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX replies_to ON replies (reply_to);
    -- a status change out of Resuming (a wait, an end): `wait` on any daemon is woken by it
    CREATE FUNCTION workflowd_notify_status() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify('workflowd_status', NEW.id);
        RETURN NULL;
    END
    $$;
    CREATE TRIGGER notify_on_status AFTER UPDATE OF status ON workflows FOR EACH ROW
    WHEN (NEW.status <> 'Resuming' AND NEW.status IS DISTINCT FROM OLD.status)
    EXECUTE FUNCTION workflowd_notify_status()
    """,
]


def list_query(
    status: str | None,
    name: str | None,
    after: tuple[float, int] | None,
    parent: str | None = None,
) -> tuple[str, list[Any]]:
    """Return `list`'s SQL, which wants its LIMIT as the last parameter, and the others.

    Rows come newest first, by (updated_at, rid): the order each list index keeps, so a page
    is read from the index in order and never sorted; a page goes on strictly after `after`.
    """
    where: list[str] = []
    params: list[Any] = []
    for column, value in (("status", status), ("name", name), ("parent", parent)):
        if value is not None:
            params.append(value)
            where.append(f"{column} = ${len(params)}")
    if after is not None:
        params += after
        where.append(f"(updated_at, rid) < (${len(params) - 1}::float8, ${len(params)}::bigint)")
    sql = f"SELECT {COLS}, rid FROM workflows"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql + f" ORDER BY updated_at DESC, rid DESC LIMIT ${len(params) + 1}", params


INSERT_WORKFLOW = (
    f"INSERT INTO workflows ({COLS}, history_seq)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
    " ON CONFLICT (id) DO NOTHING"
)


def with_history(update: str, k: int) -> str:
    """Make one statement of `update` (k parameters, `$k - 1` the entries, `$k` the id) that
    also appends history, trims it to the newest `keep` and drops applied inbox rows.

    The extra parameters: kinds text[], details text[], at, keep, inbox ids bigint[]. No row
    comes back if the workflow does not exist, and then nothing else happens either.
    """
    n, wid = f"${k - 1}", f"${k}"
    kinds, details, at, keep, inbox = (f"${k + i}" for i in range(1, 6))
    return f"""
        WITH u AS ({update}),
        appended AS (
            INSERT INTO history (workflow_id, seq, at, kind, detail)
            SELECT {wid}, u.history_seq - {n} + t.ord, {at}::float8, t.kind, t.detail
            FROM u, unnest({kinds}::text[], {details}::text[]) WITH ORDINALITY AS t(kind, detail, ord)
            WHERE u.history_seq - {n} + t.ord > u.history_seq - {keep}::bigint
        ),
        trimmed AS (
            DELETE FROM history WHERE workflow_id = {wid}
            AND seq <= (SELECT history_seq - {keep}::bigint FROM u)
        ),
        applied AS (
            DELETE FROM inbox WHERE id = ANY({inbox}::bigint[]) AND EXISTS (SELECT 1 FROM u)
        )
        SELECT history_seq FROM u
    """


_CHECKPOINT = (
    "UPDATE workflows SET status = $1, data = $2, state = $3, error = $4, attempt = $5,"
    " next_run_at = $6, updated_at = $7, history_seq = history_seq + $8 WHERE id = $9"
    " RETURNING history_seq"
)
_SET_STATUS = (
    "UPDATE workflows SET status = $1, error = $2, attempt = COALESCE($3, attempt),"
    " next_run_at = $4, updated_at = $5, history_seq = history_seq + $6 WHERE id = $7"
    " RETURNING history_seq"
)
_ADD_HISTORY = (
    "UPDATE workflows SET history_seq = history_seq + $1 WHERE id = $2 RETURNING history_seq"
)
CHECKPOINT = with_history(_CHECKPOINT, 9)
SET_STATUS = with_history(_SET_STATUS, 7)
ADD_HISTORY = with_history(_ADD_HISTORY, 2)


def fenced(update: str, k: int) -> str:
    """Make `with_history(update, k)` write only while the workflow's generation is `$k + 6`.

    A daemon that lost the workflow's lease (another one claimed it: the generation moved on)
    matches no row, so nothing at all is written.
    """
    guarded = update.replace(f"WHERE id = ${k}", f"WHERE id = ${k} AND generation = ${k + 6}")
    return with_history(guarded, k)


CHECKPOINT_FENCED = fenced(_CHECKPOINT, 9)
SET_STATUS_FENCED = fenced(_SET_STATUS, 7)
ADD_HISTORY_FENCED = fenced(_ADD_HISTORY, 2)


#: Server time, in epoch seconds: leases are compared on one clock whatever the machines say.
NOW = "extract(epoch FROM clock_timestamp())"
#: Claim up to $3 unfinished workflows nobody holds (no owner, or an expired lease) for $1
#: (node $2) until now + $4; a workflow pinned to a node is left to it unless that node was
#: not seen for $5 seconds. Returns the rows with their new generation and pin.
CLAIM = f"""
    WITH c AS (
        SELECT id FROM workflows w
        WHERE {UNFINISHED} AND lease_until < {NOW}
          AND (pin_node IS NULL OR pin_node = $2 OR NOT EXISTS (
              SELECT 1 FROM nodes n WHERE n.node_id = w.pin_node AND n.seen_at > {NOW} - $5))
        ORDER BY lease_until LIMIT $3 FOR UPDATE SKIP LOCKED
    )
    UPDATE workflows w SET owner = $1, lease_until = {NOW} + $4, generation = w.generation + 1
    FROM c WHERE w.id = c.id
    RETURNING {", ".join("w." + c.strip() for c in COLS.split(","))}, w.generation, w.pin_node
"""
#: Seconds until the first lease another daemon holds runs out (NULL: none held): the claim
#: loop looks again then, so a dead daemon's work is taken over as soon as its lease allows.
NEXT_EXPIRY = f"""
    SELECT MIN(lease_until) - {NOW} FROM workflows
    WHERE {UNFINISHED} AND lease_until > {NOW} AND owner <> $1
"""
#: Take one workflow for a write (a repair, the janitor) if nobody else holds it: returns the
#: new generation, or no row.
CLAIM_ONE = f"""
    UPDATE workflows SET owner = $2, lease_until = {NOW} + $3, generation = generation + 1
    WHERE id = $1 AND (owner IS NULL OR owner = $2 OR lease_until < {NOW} OR NOT ({UNFINISHED}))
    RETURNING generation
"""
#: Extend the leases of ($3 ids, $4 generations) still held by $1 to now + $2; returns the ids.
RENEW = f"""
    UPDATE workflows w SET lease_until = {NOW} + $2
    FROM unnest($3::text[], $4::bigint[]) AS t(id, g)
    WHERE w.id = t.id AND w.generation = t.g AND w.owner = $1
    RETURNING w.id
"""
INBOX_COLS = "id, workflow_id, event, thread_id, pc, input, created_at, kind, reply_to"
#: Hand $1 the inbox rows of the workflows in $2 (just claimed), whoever took them before.
TAKE_CLAIMED = (
    f"UPDATE inbox SET taken = $1 WHERE workflow_id = ANY($2::text[]) RETURNING {INBOX_COLS}"
)
#: Hand $1 the inbox rows it has not taken yet of the workflows it owns: new ones, and any a
#: daemon that lost the workflow took (what it applied left with its commit; it commits no more).
TAKE_NEW = f"""
    UPDATE inbox i SET taken = $1 FROM workflows w
    WHERE i.taken IS DISTINCT FROM $1 AND w.id = i.workflow_id AND w.owner = $1 AND {UNFINISHED.replace("status", "w.status")}
    RETURNING {", ".join("i." + c.strip() for c in INBOX_COLS.split(","))}
"""
#: Who owns a workflow ($1) now, by node_id: none once its lease ran out or it ended.
OWNER_OF = f"""
    SELECT n.node_id FROM workflows w JOIN nodes n ON n.holder = w.owner
    WHERE w.id = $1 AND w.lease_until > {NOW} AND {UNFINISHED.replace("status", "w.status")}
"""
INSERT_HISTORY = (
    "INSERT INTO history (workflow_id, seq, at, kind, detail) VALUES ($1, $2, $3, $4, $5)"
)
TRIM_HISTORY = "DELETE FROM history WHERE workflow_id = $1 AND seq <= $2"
DELETE_INBOX = "DELETE FROM inbox WHERE id = ANY($1::bigint[])"
SCHEDULE_COLS = "name, last_nominal, paused, buffered, last_workflow_id, last_fire_at"
ADD_SCHEDULES = (
    "INSERT INTO schedules (name, last_nominal, created_at)"
    " SELECT n, $2, $2 FROM unnest($1::text[]) AS n ON CONFLICT (name) DO NOTHING"
)
INSERT_FIRE = (
    "INSERT INTO schedule_fires (schedule, seq, at, kind, nominal, workflow_id, reason, count)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
TRIM_FIRES = "DELETE FROM schedule_fires WHERE schedule = $1 AND seq <= $2"


def redact(dsn: str) -> str:
    """Return `dsn` without its password, for logs and messages."""
    parts = urlsplit(dsn)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query, safe="/"), ""))


def connect_args(dsn: str, passfile: Path | None, name: str) -> dict[str, Any]:
    """Return the keyword arguments asyncpg connects with; `name` is the application_name."""
    args: dict[str, Any] = {"dsn": dsn, "server_settings": {"application_name": name}}
    if passfile is not None:
        args["passfile"] = str(passfile)
    return args


async def migrate(conn: asyncpg.Connection, where: str) -> None:
    """Bring the schema up to date in one transaction, under an advisory lock.

    Two daemons starting at once take turns: the second finds the work done.
    """
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATE_LOCK)
        await conn.execute("CREATE TABLE IF NOT EXISTS workflowd_schema (version INTEGER NOT NULL)")
        version = await conn.fetchval("SELECT version FROM workflowd_schema")
        if version is None:
            await conn.execute("INSERT INTO workflowd_schema (version) VALUES (0)")
            version = 0
        if version > len(MIGRATIONS):
            raise ConfigError(
                f"{where} has schema version {version}; this workflowd knows {len(MIGRATIONS)}"
            )
        for v in range(version, len(MIGRATIONS)):
            await conn.execute(MIGRATIONS[v])
            await conn.execute("UPDATE workflowd_schema SET version = $1", v + 1)


def unusable(where: str, e: BaseException) -> StoreUnusable:
    """Return the start-up error for a server we cannot use, in one line."""
    text = " ".join(str(e).split()) or type(e).__name__
    return StoreUnusable(f"cannot open {where}: {type(e).__name__}: {text}")
