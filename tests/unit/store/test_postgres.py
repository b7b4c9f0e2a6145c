"""Tests for daemon.store.postgres: what only PostgreSQL has (the shared contract is test_base)."""

from __future__ import annotations

import anyio
import asyncpg
import pytest

from daemon.errors import ConfigError, StoreUnusable, Unavailable
from daemon.store import postgres_schema as schema
from daemon.store.base import WorkflowRow
from daemon.store.postgres import PostgresStore
from daemon.store.postgres_schema import MIGRATIONS, migrate, redact


def row(wid: str) -> WorkflowRow:
    """Build a fresh workflow row."""
    return WorkflowRow(id=wid, name="Demo", status="Resuming", data='{"i":0}', state="{}")


async def fetch(dsn: str, sql: str) -> list[tuple[object, ...]]:
    """Query the database on a connection of its own."""
    conn = await asyncpg.connect(dsn)
    try:
        return [tuple(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


async def execute(dsn: str, sql: str) -> None:
    """Run statements (several, separated by `;`) on a connection of their own."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


class TestOpen:
    async def test_creates_schema_and_version(self, pg_dsn: str) -> None:
        """Opening an empty database creates the tables and records the schema version."""
        async with PostgresStore.open(pg_dsn) as store:
            assert store.where == pg_dsn
        tables = {
            r[0]
            for r in await fetch(
                pg_dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            )
        }
        assert {"workflows", "history", "inbox", "schedules", "workflowd_schema"} <= tables
        assert await fetch(pg_dsn, "SELECT version FROM workflowd_schema") == [(len(MIGRATIONS),)]

    async def test_migrations_run_once(self, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """A new migration runs on the next open and never again."""
        async with PostgresStore.open(pg_dsn):
            pass
        extra = "CREATE TABLE ran (x INTEGER); INSERT INTO ran VALUES (1)"
        monkeypatch.setattr(schema, "MIGRATIONS", [*MIGRATIONS, extra])
        for _ in range(2):
            async with PostgresStore.open(pg_dsn):
                pass
        assert await fetch(pg_dsn, "SELECT COUNT(*) FROM ran") == [(1,)]
        assert await fetch(pg_dsn, "SELECT version FROM workflowd_schema") == [
            (len(MIGRATIONS) + 1,)
        ]

    async def test_concurrent_migrations_take_turns(self, pg_dsn: str) -> None:
        """Five connections migrating at once: one does the work, none fails, no table twice."""
        conns = [await asyncpg.connect(pg_dsn) for _ in range(5)]
        try:
            async with anyio.create_task_group() as tg:
                for conn in conns:
                    tg.start_soon(migrate, conn, "db")
        finally:
            for conn in conns:
                await conn.close()
        assert await fetch(pg_dsn, "SELECT version FROM workflowd_schema") == [(len(MIGRATIONS),)]

    async def test_newer_schema_is_refused(self, pg_dsn: str) -> None:
        """A database from a newer workflowd is not touched."""
        async with PostgresStore.open(pg_dsn):
            pass
        await execute(pg_dsn, f"UPDATE workflowd_schema SET version = {len(MIGRATIONS) + 5}")
        with pytest.raises(ConfigError, match="schema version"):
            async with PostgresStore.open(pg_dsn):
                pass

    async def test_unreachable_server_names_it_without_password(self, tmp_path: str) -> None:
        """A server that is not there is one StoreUnusable line; the password is not in it."""
        dsn = f"postgresql://me:s3cret@/db?host={tmp_path}&port=1"
        with pytest.raises(StoreUnusable) as caught:
            async with PostgresStore.open(dsn):
                pass
        text = str(caught.value)
        assert "s3cret" not in text and "\n" not in text
        assert text.startswith(f"cannot open postgresql://me:***@/db?host={tmp_path}")


class TestWrites:
    async def test_checkpoint_is_atomic(self, pg_dsn: str) -> None:
        """If appending history fails, neither the row nor the inbox changes."""
        async with PostgresStore.open(pg_dsn) as store:
            await store.create(row("a"))
            put = await store.inbox_put("a", "go", None)
            await execute(
                pg_dsn,
                "CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " IF NEW.kind = 'boom' THEN RAISE EXCEPTION 'boom refused'; END IF;"
                " RETURN NEW; END $$;"
                " CREATE TRIGGER boom BEFORE INSERT ON history FOR EACH ROW EXECUTE FUNCTION boom()",
            )
            with pytest.raises(asyncpg.RaiseError, match="boom refused"):
                await store.checkpoint("a", status="Waiting", data='{"i":9}', state="{}",
                                       history=[("boom", {})], inbox_done=[put])  # fmt: skip
            got = await store.get("a")
            assert got is not None and (got.status, got.data) == ("Resuming", '{"i":0}')
            assert len(await store.inbox_pending("a")) == 1

    async def test_inbox_pending_lists_callbacks_only(self, pg_dsn: str) -> None:
        """A request queued for the owner (a cancel) is not a pending callback."""
        async with PostgresStore.open(pg_dsn) as store:
            await store.create(row("a"))
            put = await store.inbox_put("a", "go", None)
            await store.request("a", "cancel", "", None)
            assert [i.id for i in await store.inbox_pending("a")] == [put]
            assert [i.id for i in await store.inbox_pending()] == [put]
            assert await store.inbox_depth() == 2

    async def test_dropped_connection_is_replaced(self, pg_dsn: str) -> None:
        """The server ending every connection of the store fails at most the writes in flight."""
        async with PostgresStore.open(pg_dsn) as store:
            await store.create(row("a"))
            await fetch(
                pg_dsn,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            for _ in range(3):  # the pool notices a dead connection on its first use
                try:
                    await store.checkpoint("a", status="Waiting", data="{}", state="{}")
                    break
                except Exception:  # noqa: BLE001, S112 - whatever the driver raises for a dead connection
                    continue
            got = await store.get("a")
            assert got is not None and got.status == "Waiting"

    async def test_backup_points_to_pg_dump(self, pg_dsn: str, tmp_path: str) -> None:
        """`backup` on PostgreSQL is refused with what to use instead; nothing is written."""
        async with PostgresStore.open(pg_dsn) as store:
            with pytest.raises(Unavailable, match="pg_dump"):
                await store.backup(anyio.Path(tmp_path) / "copy")  # type: ignore[arg-type]


class TestSchemaSince:
    """What the schema gained with parents, list pages and hooks, on databases old and new."""

    async def test_a_database_from_before_gets_the_columns(self, pg_dsn: str) -> None:
        """A database at schema version 3 is migrated: old rows get no parent and a row id."""
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute("CREATE TABLE workflowd_schema (version INTEGER NOT NULL)")
            for step in MIGRATIONS[:3]:
                await conn.execute(step)
            await conn.execute("INSERT INTO workflowd_schema VALUES (3)")
            await conn.execute(
                "INSERT INTO workflows (id, name, status, data, state, created_at, updated_at)"
                " VALUES ('old1', 'Demo', 'Waiting', '{}', '{}', 1, 1),"
                " ('old2', 'Demo', 'Waiting', '{}', '{}', 1, 1)"
            )
        finally:
            await conn.close()
        async with PostgresStore.open(pg_dsn) as store:
            got = await store.get("old1")
            assert got is not None and (got.parent, got.deadline) == (None, None)
            first, after = await store.page(limit=1)
            rest, end = await store.page(limit=1, after=after)
            assert {r.id for r in first + rest} == {"old1", "old2"} and end is None
            await store.set_status("old1", status="Finished")
            assert [h.workflow_id for h in await store.hooks_pending()] == ["old1"]

    async def test_every_list_query_reads_an_index_in_order(self, pg_dsn: str) -> None:
        """EXPLAIN of each list query: an index scan whose order needs no Sort."""
        async with PostgresStore.open(pg_dsn):
            pass
        conn = await asyncpg.connect(pg_dsn)
        try:
            # With no rows a sequential scan and a sort are cheapest; forbid them so the plan
            # shows whether an index can deliver the rows in the order asked for.
            await conn.execute("SET enable_seqscan = off; SET enable_sort = off")
            for status in (None, "Waiting"):
                for name in (None, "Demo"):
                    for parent in (None, "p"):
                        for after in (None, (1.0, 5)):
                            sql, params = schema.list_query(status, name, after, parent)
                            plan = "\n".join(
                                r[0] for r in await conn.fetch(f"EXPLAIN {sql}", *params, 10)
                            )
                            where = (status, name, parent, after, plan)
                            # One of the filters' own indexes (the plain one with none).
                            fits = [
                                index
                                for index, value in (
                                    ("workflows_parent", parent),
                                    ("workflows_status_updated", status),
                                    ("workflows_name_updated", name),
                                )
                                if value
                            ] or ["workflows_updated"]
                            used = [f"Backward using {i} " in plan for i in fits]
                            assert any(used), where
                            assert "Sort" not in plan and "Seq Scan" not in plan, where
        finally:
            await conn.close()

    async def test_the_ending_trigger_is_in_the_commit(self, pg_dsn: str) -> None:
        """An ending rolled back with its batch (a history row refused) queues no hook."""
        async with PostgresStore.open(pg_dsn) as store:
            await store.create(row("a"))
            await execute(
                pg_dsn,
                "CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " RAISE EXCEPTION 'boom refused'; END $$;"
                " CREATE TRIGGER boom BEFORE INSERT ON history FOR EACH ROW EXECUTE FUNCTION boom()",
            )
            with pytest.raises(asyncpg.RaiseError, match="boom refused"):
                await store.set_status("a", status="Failed", history=[("failed", {})])
            assert await store.hooks_pending() == []
            await store.set_status("a", status="Failed")
            assert [h.status for h in await store.hooks_pending()] == ["Failed"]


def test_redact() -> None:
    """A password is masked wherever the DSN holds it; the rest is kept."""
    assert redact("postgresql://u:pw@h:5/db?sslmode=require") == (
        "postgresql://u:***@h:5/db?sslmode=require"
    )
    assert redact("postgresql://u@/db?host=/tmp/x&password=pw") == (
        "postgresql://u@/db?host=/tmp/x&password=%2A%2A%2A"
    )
