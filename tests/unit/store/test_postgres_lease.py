"""Tests for daemon.store.postgres_lease: one holder at a time, standbys, fencing."""

from __future__ import annotations

import anyio
import asyncpg
import pytest

from daemon.store.base import WorkflowRow
from daemon.store.postgres import PostgresStore
from daemon.store.postgres_lease import LeaseLost, holder_name


async def execute(dsn: str, sql: str) -> None:
    """Run statements on a connection of their own (another daemon, as far as the store sees)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def row(wid: str) -> WorkflowRow:
    """Build a fresh workflow row."""
    return WorkflowRow(id=wid, name="Demo", status="Resuming", data='{"i":0}', state="{}")


async def test_standby_gets_the_lease_when_the_holder_closes(pg_dsn: str) -> None:
    """A second open waits while the first holds the lease, and gets it once that one closes."""
    opened = anyio.Event()
    generations: list[int] = []

    async def second() -> None:
        async with PostgresStore.open(pg_dsn, node_id="b", lease_s=1.0) as store:
            generations.append(store.lease.generation)
            opened.set()

    async with anyio.create_task_group() as tg:
        async with PostgresStore.open(pg_dsn, node_id="a", lease_s=1.0) as first:
            generations.append(first.lease.generation)
            tg.start_soon(second)
            # Three lease terms: a standby that ignored the live holder would have opened.
            with anyio.move_on_after(3.0):
                await opened.wait()
            assert not opened.is_set()
        with anyio.fail_after(5):
            await opened.wait()
    assert generations == [1, 2]


async def test_a_lost_lease_fences_every_write(pg_dsn: str) -> None:
    """Once another daemon took the lease, no write lands, and the block ends in LeaseLost."""
    with pytest.raises(LeaseLost):
        async with PostgresStore.open(pg_dsn, node_id="a", lease_s=30.0) as store:
            await store.create(row("w"))
            await execute(
                pg_dsn,
                "UPDATE leases SET holder = 'other', node_id = 'b', generation = generation + 1",
            )
            with pytest.raises(LeaseLost):
                await store.checkpoint("w", status="Waiting", data='{"i":1}', state="{}")
            with pytest.raises(LeaseLost):
                await store.inbox_put("w", "go", None)
            await anyio.sleep_forever()  # the store cancels the block once the lease is lost
    async with PostgresStore.open(pg_dsn, node_id="c", lease_s=30.0) as store:
        got = await store.get("w")
        assert got is not None and (got.status, got.data) == ("Resuming", '{"i":0}')
        assert await store.inbox_pending() == []


async def test_an_expired_lease_is_taken_while_its_holder_is_connected(pg_dsn: str) -> None:
    """A holder that stops renewing (a partition) loses the lease although still connected."""
    with pytest.raises(LeaseLost):
        async with PostgresStore.open(pg_dsn, node_id="a", lease_s=30.0) as store:
            await execute(pg_dsn, "UPDATE leases SET until = 0")  # as if renewals stopped
            claim = await PostgresStore.claim(pg_dsn, node_id="b", lease_s=30.0)
            try:
                assert claim.lease.generation == 2
                with pytest.raises(LeaseLost):
                    await store.create(row("w"))
                await anyio.sleep_forever()  # the store cancels the block once the lease is lost
            finally:
                with anyio.CancelScope(shield=True):
                    await claim.conn.close()


def test_holder_name_fits_application_name() -> None:
    """The name fits PostgreSQL's 63-byte application_name and differs per call."""
    long = holder_name("n" * 200)
    assert len(long) <= 63 and long.startswith("workflowd ")
    assert holder_name("a") != holder_name("a")
