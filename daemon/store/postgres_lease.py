"""This daemon on a shared PostgreSQL database: its name, its heartbeat, the leader row.

Every daemon notes itself in `nodes` every `lease_s / 3` (server time, so the machines'
clocks need not agree); `ping` lists the ones seen within a lease. The singleton duties
(retention, the janitor, hooks) run on the daemon holding the `leader` row of `leases`,
renewed on the same beat and taken over by another daemon once it has not been renewed for
`lease_s`, or at once when its holder has no connection left (it was killed).
The leases of the workflows themselves live in their rows (daemon.store.postgres).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from daemon.store import postgres_schema as schema
from daemon.store.postgres_schema import NOW
from daemon.store.postgres_writer import Conn

SEEN = (
    f"INSERT INTO nodes (holder, node_id, seen_at) VALUES ($1, $2, {NOW})"
    f" ON CONFLICT (holder) DO UPDATE SET seen_at = {NOW}"
)
GONE = "DELETE FROM nodes WHERE holder = $1"
#: A daemon that died without saying goodbye is listed as long as it might still be alive,
#: and its row is dropped a day later (a daemon notes itself under a new name each start).
FORGET = f"DELETE FROM nodes WHERE seen_at < {NOW} - 86400"
#: Take or keep the leader row: ours if it is, or if its holder let it lapse.
LEAD = f"""
    INSERT INTO leases AS l (name, holder, node_id, until, generation)
    VALUES ('leader', $1, $2, {NOW} + $3, 1)
    ON CONFLICT (name) DO UPDATE
        SET holder = $1, node_id = $2, until = {NOW} + $3,
            generation = CASE WHEN l.holder = $1 THEN l.generation ELSE l.generation + 1 END
        WHERE l.holder = $1 OR l.until < {NOW}
           OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.application_name = l.holder)
    RETURNING generation
"""
#: At start: the workflows an earlier process of this node held, if it has no connection
#: left (it was killed), are free at once rather than after their leases ran out.
ORPHANS = f"""
    UPDATE workflows SET lease_until = 0
    WHERE {schema.UNFINISHED} AND lease_until > 0 AND owner <> $1
      AND owner IN (SELECT holder FROM nodes WHERE node_id = $2 AND holder <> $1)
      AND NOT EXISTS (
          SELECT 1 FROM pg_stat_activity a WHERE a.application_name = workflows.owner)
"""
#: The daemons seen within $1 seconds, the leader marked.
NODES = f"""
    SELECT n.node_id, n.holder = l.holder AND l.until > {NOW}, {NOW} - n.seen_at
    FROM nodes n LEFT JOIN leases l ON l.name = 'leader'
    WHERE n.seen_at > {NOW} - $1 ORDER BY n.node_id, n.holder
"""
#: A clean stop: the leader row and every workflow lease of this daemon lapse at once.
RESIGN = "UPDATE leases SET until = 0 WHERE name = 'leader' AND holder = $1"
RELEASE_ALL = f"UPDATE workflows SET lease_until = 0 WHERE owner = $1 AND {schema.UNFINISHED}"


def holder_name(node_id: str) -> str:
    """Return a name for this process's connections, unique among the database's clients.

    It is the connections' application_name (at most 63 bytes) and the `owner` of the
    workflows this process holds.
    """
    return f"workflowd {node_id[:40]} {os.getpid()} {secrets.token_hex(3)}"[:63]


@dataclass(slots=True)
class Node:
    """This daemon as the other daemons on the database see it."""

    holder: str
    node_id: str
    lease_s: float
    #: Whether this daemon held the leader row at its last beat.
    leader: bool = False

    async def beat(self, conn: Conn) -> None:
        """Note that this daemon lives, and take or keep the leader row if free."""
        await conn.execute(SEEN, self.holder, self.node_id)
        await conn.execute(FORGET)
        self.leader = await conn.fetchval(LEAD, self.holder, self.node_id, self.lease_s) is not None

    async def nodes(self, conn: Conn) -> list[dict[str, Any]]:
        """Return the daemons seen within a lease, the leader marked."""
        rows = await conn.fetch(NODES, self.lease_s)
        return [
            {"node_id": n, "role": "leader" if leads else "member", "seen_s_ago": round(ago, 1)}
            for n, leads, ago in rows
        ]

    async def goodbye(self, conn: Conn) -> None:
        """Leave at a clean stop: the others take the leader row and the workflows at once."""
        await conn.execute(RELEASE_ALL, self.holder)
        await conn.execute(RESIGN, self.holder)
        await conn.execute(GONE, self.holder)
        await conn.execute("SELECT pg_notify('workflowd_work', '')")


@dataclass(frozen=True, slots=True)
class Opened:
    """A database brought up to date, and how to connect to it as this daemon."""

    where: str
    args: dict[str, Any]
    node: Node


async def connect(
    dsn: str, *, passfile: Path | None = None, node_id: str = "", lease_s: float = 15.0
) -> Opened:
    """Connect once and migrate; a server that cannot be used raises StoreUnusable (one line)."""
    where = schema.redact(dsn)
    node_id = node_id or socket.gethostname()
    node = Node(holder_name(node_id), node_id, lease_s)
    args = schema.connect_args(dsn, passfile, node.holder)
    conn: asyncpg.Connection | None = None
    try:
        conn = await asyncpg.connect(**args)
        await schema.migrate(conn, where)
        await conn.execute(ORPHANS, node.holder, node.node_id)
        await node.beat(conn)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
        raise schema.unusable(where, e) from None
    finally:
        if conn is not None:
            await close(conn)
    return Opened(where, args, node)


async def close(conn: Conn) -> None:
    """Close a connection, also while the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        await conn.close()
