"""Tests for daemon.store.sqlite: what only SQLite has (the shared contract is test_base)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from daemon.clock import FakeClock, use_clock
from daemon.errors import ConfigError, StoreLocked, StoreUnusable
from daemon.store import schema as schema_module
from daemon.store.base import WorkflowRow
from daemon.store.schema import MIGRATIONS
from daemon.store.sqlite import SQLiteStore
from tests.helpers import REPO


def row(wid: str, status: str = "Resuming", name: str = "Demo") -> WorkflowRow:
    """Build a fresh workflow row."""
    return WorkflowRow(id=wid, name=name, status=status, data='{"i":0}', state='{"threads":[]}')


@contextlib.contextmanager
def fake_clock(start: float = 1000.0) -> Iterator[FakeClock]:
    """Make a FakeClock the current clock for the block."""
    clock = FakeClock(start)
    token = use_clock(clock)
    try:
        yield clock
    finally:
        token.var.reset(token)


def raw(db: Path, sql: str) -> list[tuple[object, ...]]:
    """Query the database with a plain sqlite3 connection."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def pragma(store: SQLiteStore, text: str) -> object:
    """Run `PRAGMA text` on the store's write connection and return its first value, if any."""
    row = await store._writes.call(lambda conn: conn.execute(f"PRAGMA {text}").fetchone())
    return None if row is None else row[0]


class TestOpen:
    async def test_creates_schema_and_version(self, tmp_path: Path) -> None:
        """Opening a new path creates the directory, the tables and sets user_version."""
        db = tmp_path / "state" / "wf.db"
        async with SQLiteStore.open(db) as store:
            assert store.path == db
        tables = {r[0] for r in raw(db, "SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"workflows", "history", "inbox"} <= tables
        assert raw(db, "PRAGMA user_version") == [(len(MIGRATIONS),)]
        assert raw(db, "PRAGMA journal_mode") == [("wal",)]

    async def test_migrations_run_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A new migration runs on the next open and never again."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db):
            pass
        extra = "CREATE TABLE ran (x INTEGER); INSERT INTO ran VALUES (1);"
        monkeypatch.setattr(schema_module, "MIGRATIONS", [*MIGRATIONS, extra])
        for _ in range(2):
            async with SQLiteStore.open(db):
                pass
        assert raw(db, "SELECT COUNT(*) FROM ran") == [(1,)]
        assert raw(db, "PRAGMA user_version") == [(len(MIGRATIONS) + 1,)]

    async def test_newer_schema_is_refused(self, tmp_path: Path) -> None:
        """A database from a newer workflowd is not touched."""
        db = tmp_path / "wf.db"
        raw(db, f"PRAGMA user_version = {len(MIGRATIONS) + 5}")
        with pytest.raises(ConfigError, match="schema version"):
            async with SQLiteStore.open(db):
                pass

    async def test_synchronous_full(self, tmp_path: Path) -> None:
        """synchronous='full' sets FULL on the write connection."""
        async with SQLiteStore.open(tmp_path / "wf.db", synchronous="full") as store:
            assert await pragma(store, "synchronous") == 2
            assert await store.create(row("a"))

    async def test_bad_synchronous(self, tmp_path: Path) -> None:
        """Any synchronous value other than normal/full is a configuration error."""
        with pytest.raises(ConfigError, match="synchronous"):
            async with SQLiteStore.open(tmp_path / "wf.db", synchronous="off"):
                pass


class TestLock:
    SCRIPT = (
        "import sys, anyio\n"
        "from daemon.store.sqlite import SQLiteStore\n"
        "from daemon.errors import StoreLocked\n"
        "async def main():\n"
        "    try:\n"
        "        async with SQLiteStore.open(sys.argv[1]):\n"
        "            print('opened')\n"
        "    except StoreLocked as e:\n"
        "        print('locked:', e)\n"
        "anyio.run(main)\n"
    )

    async def open_elsewhere(self, db: Path) -> str:
        """Open the store in another process and return what it printed."""
        result = await anyio.run_process([sys.executable, "-c", self.SCRIPT, str(db)], cwd=REPO)
        return result.stdout.decode().strip()

    async def test_second_process_is_refused(self, tmp_path: Path) -> None:
        """Another process cannot open a database this one holds, and can once it is closed."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db):
            assert await self.open_elsewhere(db) == (
                f"locked: another workflowd holds {db} (lock {db}.lock)"
            )
        assert await self.open_elsewhere(db) == "opened"

    async def test_second_open_in_process_is_refused(self, tmp_path: Path) -> None:
        """Opening the same database twice in one process raises StoreLocked."""
        async with SQLiteStore.open(tmp_path / "wf.db"):
            with pytest.raises(StoreLocked, match="another workflowd holds"):
                async with SQLiteStore.open(tmp_path / "wf.db"):
                    pass


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """Run the block under another umask (this process's own: no thread makes files meanwhile)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """Make `path` immutable (chattr +i) for the block; skip if the file system cannot."""
    try:
        subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"chattr +i does not work here: {e}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def mode(path: Path) -> int:
    """Return a file's permission bits."""
    return path.stat().st_mode & 0o7777


class TestFiles:
    @pytest.mark.parametrize("mask", [0o000, 0o022, 0o277])
    async def test_private_whatever_the_umask(self, tmp_path: Path, mask: int) -> None:
        """The folder the store creates is 0700; the database, -wal, -shm, lock, backup 0600."""
        db = tmp_path / "new" / "state" / "wf.db"
        with umask(mask):
            async with SQLiteStore.open(db) as store:
                assert await store.create(row("a"))
                await store.backup(tmp_path / "copy.db")
                files = [db, *(db.with_name(db.name + s) for s in ("-wal", "-shm", ".lock"))]
                modes = {p.name: mode(p) for p in [*files, tmp_path / "copy.db"]}
        assert mode(db.parent) == 0o700
        assert modes == dict.fromkeys(modes, 0o600) and len(modes) == 5
        assert sorted(p.name for p in db.parent.iterdir()) == ["wf.db", "wf.db.lock"]

    async def test_existing_files_are_made_private(self, tmp_path: Path) -> None:
        """A database left readable by an older version is made 0600; its folder is left as is."""
        db = tmp_path / "wf.db"
        raw(db, "PRAGMA user_version = 0")
        os.chmod(db, 0o644)
        os.chmod(tmp_path, 0o755)
        async with SQLiteStore.open(db) as store:
            assert await store.create(row("a"))
            assert mode(db.with_name("wf.db-wal")) == 0o600
        assert mode(db) == 0o600 and mode(tmp_path) == 0o755

    async def test_immutable_database_is_refused(self, tmp_path: Path) -> None:
        """A database that cannot be written is refused at open, naming it and the errno."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            assert await store.create(row("a"))
        with immutable(db), pytest.raises(StoreUnusable) as caught:
            async with SQLiteStore.open(db):
                pass
        assert str(caught.value) == f"cannot write {db}: [Errno 1] Operation not permitted (EPERM)"

    async def test_immutable_folder_is_refused(self, tmp_path: Path) -> None:
        """A folder that takes no new file (SQLite makes -wal and -shm there) is refused too."""
        db = tmp_path / "state" / "wf.db"
        async with SQLiteStore.open(db):
            pass
        with immutable(db.parent), pytest.raises(StoreUnusable, match="EPERM") as caught:
            async with SQLiteStore.open(db):
                pass
        assert str(db.parent) in str(caught.value)

    async def test_folder_that_is_a_file(self, tmp_path: Path) -> None:
        """A [store] path under a regular file is refused with one line."""
        (tmp_path / "f").write_text("")
        with pytest.raises(StoreUnusable, match="not a folder"):
            async with SQLiteStore.open(tmp_path / "f" / "wf.db"):
                pass


class TestWrites:
    async def test_checkpoint_is_atomic(self, tmp_path: Path) -> None:
        """If appending history fails, neither the row nor the inbox changes."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            await store.create(row("a"))
            put = await store.inbox_put("a", "go", None)
        raw(db, "CREATE TRIGGER boom BEFORE INSERT ON history WHEN NEW.kind = 'boom'"
                " BEGIN SELECT RAISE(ABORT, 'boom refused'); END")  # fmt: skip
        async with SQLiteStore.open(db) as store:
            with pytest.raises(sqlite3.IntegrityError, match="boom refused"):
                await store.checkpoint("a", status="Waiting", data='{"i":9}', state="{}",
                                       history=[("boom", {})], inbox_done=[put])  # fmt: skip
            got = await store.get("a")
            assert got is not None and (got.status, got.data) == ("Resuming", '{"i":0}')
            assert len(await store.inbox_pending("a")) == 1


class TestGroupCommit:
    async def test_disk_full_fails_alone(self, tmp_path: Path) -> None:
        """A write that hits SQLITE_FULL fails alone; the small writes of its batch commit."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            for i in range(20):
                await store.create(row(f"w{i}"))
            pages = await pragma(store, "page_count")
            await pragma(store, f"max_page_count = {pages}")
            errors: list[BaseException] = []

            async def save(wid: str, data: str) -> None:
                try:
                    await store.checkpoint(wid, status="Waiting", data=data, state="{}")
                except sqlite3.Error as e:
                    errors.append(e)

            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(save, f"w{i}", "x" * 1_000_000 if i == 7 else '{"i":1}')
            assert len(errors) == 1 and "full" in str(errors[0])
            assert store.stats.splits == 1
            assert (await store.counts()) == {"Waiting": 19, "Resuming": 1}
            got = await store.get("w7")
            assert got is not None and got.data == '{"i":0}'

    async def test_busy_database_fails_batch_without_retries(self, tmp_path: Path) -> None:
        """When another connection holds the write lock, the batch fails as a whole, unsplit."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            for i in range(10):
                await store.create(row(f"w{i}"))
            await pragma(store, "busy_timeout = 50")
            intruder = sqlite3.connect(db, isolation_level=None)
            intruder.execute("BEGIN IMMEDIATE")
            errors: list[BaseException] = []

            async def save(wid: str) -> None:
                try:
                    await store.checkpoint(wid, status="Waiting", data="{}", state="{}")
                except sqlite3.OperationalError as e:
                    errors.append(e)

            try:
                async with anyio.create_task_group() as tg:
                    for i in range(10):
                        tg.start_soon(save, f"w{i}")
            finally:
                intruder.close()
            assert len(errors) == 10 and all("locked" in str(e) for e in errors)
            assert store.stats.splits == 0
            await store.checkpoint("w0", status="Waiting", data="{}", state="{}")
            assert await store.counts() == {"Waiting": 1, "Resuming": 9}


class TestParentsAndDeadlines:
    async def test_a_database_from_before_gets_the_columns(self, tmp_path: Path) -> None:
        """A database at the previous schema version is migrated; its rows have no parent."""
        db = tmp_path / "wf.db"
        conn = sqlite3.connect(db)
        for step in MIGRATIONS[:2]:
            conn.executescript(step)
        conn.execute(
            "INSERT INTO workflows (id, name, status, data, state, created_at, updated_at)"
            " VALUES ('old', 'Demo', 'Waiting', '{}', '{}', 1, 1)"
        )
        conn.execute("PRAGMA user_version = 2")
        conn.commit()
        conn.close()
        async with SQLiteStore.open(db) as store:
            got = await store.get("old")
            assert got is not None and (got.parent, got.deadline) == (None, None)


class TestListPages:
    """`list` pages: keyset order from the indexes, stable while rows change."""

    def test_every_list_query_reads_an_index_in_order(self, tmp_path: Path) -> None:
        """EXPLAIN QUERY PLAN of each list query uses an index and no temporary B-tree."""
        db = sqlite3.connect(tmp_path / "plan.db")
        for step in MIGRATIONS:
            db.executescript(step)
        for status in (None, "Waiting"):
            for name in (None, "Demo"):
                for after in (None, (1.0, 5)):
                    sql, params = schema_module.list_query(status, name, after)
                    plan = " | ".join(
                        r[3] for r in db.execute(f"EXPLAIN QUERY PLAN {sql}", [*params, 10])
                    )
                    assert "USING INDEX workflows_" in plan, (status, name, after, plan)
                    assert "TEMP B-TREE" not in plan, (status, name, after, plan)
        db.close()
