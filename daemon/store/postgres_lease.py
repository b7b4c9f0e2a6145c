"""The database lease: one daemon at a time writes a PostgreSQL database; the others stand by.

The holder renews a row of `leases` every `lease_s / 3` (server time, so clocks of the
machines need not agree). A standby takes the lease when it has expired, or at once when no
connection of the holder is left on the server (the holder died: SIGKILL closes its sockets).
Taking it bumps `generation`; every write transaction first checks the generation with
`FOR SHARE`, so a takeover waits for a batch in flight and a daemon that lost the lease (a
partition, SIGSTOP) writes nothing: its next batch fails and it stops.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import structlog

from daemon.errors import Unavailable
from daemon.store import postgres_schema as schema
from daemon.store.postgres_writer import Conn

log = structlog.get_logger(__name__)
NOW = "extract(epoch FROM clock_timestamp())"
#: How often a standby looks at the lease at most (it also looks every lease_s / 3).
STANDBY_POLL_S = 0.5

ACQUIRE = f"""
    INSERT INTO leases AS l (name, holder, node_id, until, generation)
    VALUES ('daemon', $1, $2, {NOW} + $3, 1)
    ON CONFLICT (name) DO UPDATE
        SET holder = $1, node_id = $2, until = {NOW} + $3, generation = l.generation + 1
        WHERE l.until < {NOW}
           OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.application_name = l.holder)
    RETURNING generation
"""
RENEW = (
    f"UPDATE leases SET until = {NOW} + $3 WHERE name = 'daemon' AND holder = $1"
    " AND generation = $2 RETURNING generation"
)
FENCE = (
    "SELECT generation FROM leases WHERE name = 'daemon' AND holder = $1 AND generation = $2"
    " FOR SHARE"
)
RELEASE = "UPDATE leases SET until = 0 WHERE name = 'daemon' AND holder = $1 AND generation = $2"
SEEN = (
    f"INSERT INTO nodes (holder, node_id, seen_at) VALUES ($1, $2, {NOW})"
    f" ON CONFLICT (holder) DO UPDATE SET seen_at = {NOW}"
)
GONE = "DELETE FROM nodes WHERE holder = $1"
#: A daemon that died without saying goodbye is listed as long as it might still be alive,
#: and its row is dropped a day later (a daemon notes itself under a new name each start).
FORGET = f"DELETE FROM nodes WHERE seen_at < {NOW} - 86400"
#: The daemons seen within $1 seconds (each one notes itself every lease_s / 3 at most).
NODES = f"""
    SELECT n.node_id, n.holder = l.holder AND l.until > {NOW}, {NOW} - n.seen_at
    FROM nodes n LEFT JOIN leases l ON l.name = 'daemon'
    WHERE n.seen_at > {NOW} - $1 ORDER BY n.node_id, n.holder
"""
HOLDER = "SELECT node_id, holder, until - " + NOW + " FROM leases WHERE name = 'daemon'"


class LeaseLost(Unavailable):
    """Another daemon took this database over: this one wrote nothing since, and stops."""


def holder_name(node_id: str) -> str:
    """Return a name for this process's connections, unique among the database's clients.

    It is the connections' application_name (at most 63 bytes), by which a standby sees that
    the holder is gone.
    """
    return f"workflowd {node_id[:40]} {os.getpid()} {secrets.token_hex(3)}"[:63]


@dataclass(slots=True)
class Lease:
    """The lease this daemon holds, or held."""

    holder: str
    node_id: str
    lease_s: float
    generation: int = 0
    lost: bool = False
    #: Set once the lease is lost, so the keeper stops at once when a write found out first.
    gone: anyio.Event = field(default_factory=anyio.Event)

    def lose(self) -> None:
        """Write nothing more: another daemon holds the database now."""
        self.lost = True
        self.gone.set()

    async def acquire(self, conn: Conn, standby: anyio.Event | None = None) -> None:
        """Wait as a standby until the lease is ours; log `lease_standby` once while waiting.

        `standby` is set once it is clear that another daemon holds the lease.
        """
        waiting = False
        while True:
            generation = await conn.fetchval(ACQUIRE, self.holder, self.node_id, self.lease_s)
            if generation is not None:
                await conn.execute(SEEN, self.holder, self.node_id)
                self.generation = generation
                log.info("lease_acquired", node_id=self.node_id, generation=generation)
                return
            await conn.execute(SEEN, self.holder, self.node_id)
            if not waiting:
                row = await conn.fetchrow(HOLDER)
                owner = row[0] if row is not None else None
                log.info("lease_standby", node_id=self.node_id, holder_node=owner)
                waiting = True
                if standby is not None:
                    standby.set()
            await anyio.sleep(min(STANDBY_POLL_S, self.lease_s / 3))

    async def fence(self, conn: Conn) -> None:
        """Raise LeaseLost unless the lease is still ours; called first in each transaction."""
        if self.lost:
            raise LeaseLost("this daemon lost the database's lease")
        if await conn.fetchval(FENCE, self.holder, self.generation) is None:
            self.lose()
            raise LeaseLost("this daemon lost the database's lease")

    async def keep(self, pool: asyncpg.Pool) -> None:
        """Renew every lease_s / 3 until lost; then raise LeaseLost.

        A server that cannot be reached is retried; once a whole lease has passed without a
        renewal the lease counts as lost here too, as another daemon may hold it by now.
        """
        renewed = anyio.current_time()
        while True:
            with anyio.move_on_after(self.lease_s / 3):
                await self.gone.wait()
            if self.lost:
                break
            try:
                ok = await pool.fetchval(RENEW, self.holder, self.generation, self.lease_s)
                await pool.execute(SEEN, self.holder, self.node_id)
                await pool.execute(FORGET)
            except Exception as e:  # noqa: BLE001 - any failure to renew is retried, never fatal
                log.warning("lease_renew_failed", error=f"{type(e).__name__}: {e}")
                if anyio.current_time() - renewed < self.lease_s:
                    continue
                ok = None
            if ok is None:
                break
            renewed = anyio.current_time()
        self.lose()
        log.error("lease_lost", node_id=self.node_id, generation=self.generation)
        raise LeaseLost("another daemon took this database over")

    async def nodes(self, conn: Conn) -> list[dict[str, Any]]:
        """Return the daemons seen lately on this database, the lease holder marked."""
        rows = await conn.fetch(NODES, self.lease_s)
        return [
            {"node_id": n, "role": "holder" if holds else "standby", "seen_s_ago": round(ago, 1)}
            for n, holds, ago in rows
        ]

    async def release(self, conn: Conn) -> None:
        """Let a standby take over at once (a clean stop)."""
        await conn.execute(GONE, self.holder)
        if not self.lost:
            await conn.execute(RELEASE, self.holder, self.generation)


@dataclass(frozen=True, slots=True)
class Claim:
    """A connection holding the database's lease, and how to open more like it."""

    where: str
    args: dict[str, Any]
    conn: asyncpg.Connection
    lease: Lease


async def claim(
    dsn: str,
    *,
    passfile: Path | None = None,
    node_id: str = "",
    lease_s: float = 15.0,
    standby: anyio.Event | None = None,
) -> Claim:
    """Connect, migrate, and wait as a standby until this daemon holds the database's lease.

    A server that cannot be reached or refuses us at first raises StoreUnusable (one line, no
    password), so the daemon refuses to start rather than fail after it reported READY. Once
    it stands by, a lost connection (the server restarting) is retried with backoff instead:
    a standby may wait for days.
    """
    where = schema.redact(dsn)
    node_id = node_id or socket.gethostname()
    lease = Lease(holder_name(node_id), node_id, lease_s)
    args = schema.connect_args(dsn, passfile, lease.holder)
    backoff, connected = STANDBY_POLL_S, False
    while True:
        conn: asyncpg.Connection | None = None
        try:
            conn = await asyncpg.connect(**args)
            await schema.migrate(conn, where)
            connected = True
            await lease.acquire(conn, standby)
            return Claim(where, args, conn, lease)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
            if conn is not None:
                await close(conn)
            if not connected:
                raise schema.unusable(where, e) from None
            log.warning("lease_standby_retry", error=f"{type(e).__name__}: {e}", in_s=backoff)
        except BaseException:  # stopped while standing by: `ping` need not list it any more
            if conn is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await conn.execute(GONE, lease.holder)
                await close(conn)
            raise
        await anyio.sleep(backoff)
        backoff = min(backoff * 2, max(lease_s, 5.0))


async def release(claim: Claim) -> None:
    """Hand a claimed lease back unused and disconnect."""
    with anyio.CancelScope(shield=True):
        try:
            with contextlib.suppress(Exception):  # a lost connection released it already
                await claim.lease.release(claim.conn)
        finally:
            await claim.conn.close()


async def close(conn: Conn) -> None:
    """Close a connection, also while the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        await conn.close()
