"""Tests for daemon.store against real SQLite files."""

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
from daemon.errors import ConfigError, StoreLocked, StoreUnusable, Unavailable, WorkflowNotFound
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

    async def test_reopen_keeps_data(self, tmp_path: Path) -> None:
        """Rows written before a close are there after reopening."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            await store.create(row("a"), history=[("created", {"by": "test"})])
        async with SQLiteStore.open(db) as store:
            got = await store.get("a")
            assert got is not None and got.name == "Demo" and got.created_at > 0
            assert [h.kind for h in await store.history("a")] == ["created"]

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
            assert list(await store._writer.execute_fetchall("PRAGMA synchronous")) == [(2,)]
            assert await store.create(row("a"))

    async def test_bad_synchronous(self, tmp_path: Path) -> None:
        """Any synchronous value other than normal/full is a configuration error."""
        with pytest.raises(ConfigError, match="synchronous"):
            async with SQLiteStore.open(tmp_path / "wf.db", synchronous="off"):
                pass

    async def test_closed_store_refuses_writes(self, tmp_path: Path) -> None:
        """A write after the store closed raises Unavailable."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            pass
        with pytest.raises(Unavailable):
            await store.create(row("a"))

    async def test_body_error_propagates_and_unlocks(self, tmp_path: Path) -> None:
        """An error inside the block comes out as is, and the database is released."""
        db = tmp_path / "wf.db"
        with pytest.raises(KeyError, match="boom"):
            async with SQLiteStore.open(db) as store:
                await store.create(row("a"))
                raise KeyError("boom")
        async with SQLiteStore.open(db) as store:
            assert await store.get("a") is not None

    async def test_cancel_unlocks(self, tmp_path: Path) -> None:
        """Cancelling the block closes the store and releases the lock."""
        db = tmp_path / "wf.db"
        with anyio.move_on_after(0.05):
            async with SQLiteStore.open(db) as store:
                await anyio.sleep_forever()
        async with SQLiteStore.open(db) as store:
            assert await store.counts() == {}

    async def test_queued_writes_are_drained(self, tmp_path: Path) -> None:
        """Writes queued when the store closes are committed, not dropped."""
        db = tmp_path / "wf.db"
        async with anyio.create_task_group() as tg, SQLiteStore.open(db) as store:
            for i in range(50):
                tg.start_soon(store.create, row(f"w{i}"))
            await anyio.lowlevel.checkpoint()
        assert raw(db, "SELECT COUNT(*) FROM workflows") == [(50,)]


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
    async def test_create_is_idempotent(self, tmp_path: Path) -> None:
        """A second create with the same id returns False and changes nothing."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            assert await store.create(row("a"), history=[("created", {})])
            other = WorkflowRow(id="a", name="Other", status="Waiting", data="{}", state="{}")
            assert not await store.create(other, history=[("created", {})])
            got = await store.get("a")
            assert got is not None and (got.name, got.status) == ("Demo", "Resuming")
            assert len(await store.history("a")) == 1

    async def test_checkpoint_writes_everything(self, tmp_path: Path) -> None:
        """A checkpoint updates the row, appends history and drops applied inbox rows."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            await store.create(row("a"))
            first = await store.inbox_put("a", "go", {"n": 1}, thread_id="main", pc=3)
            second = await store.inbox_put("a", "go", {"n": 2})
            await store.checkpoint(
                "a", status="Waiting", data='{"i":1}', state="{}", attempt=2, next_run_at=5.0,
                history=[("step", {"name": "s1"}), ("wait", {"name": "w"})], inbox_done=[first],
            )  # fmt: skip
            got = await store.get("a")
            assert got is not None
            assert (got.status, got.data, got.attempt, got.next_run_at) == (
                "Waiting", '{"i":1}', 2, 5.0,
            )  # fmt: skip
            assert [(h.kind, h.detail) for h in await store.history("a")] == [
                ("step", {"name": "s1"}), ("wait", {"name": "w"}),
            ]  # fmt: skip
            assert [i.id for i in await store.inbox_pending("a")] == [second]

    async def test_checkpoint_unknown_id(self, tmp_path: Path) -> None:
        """A checkpoint of an unknown workflow raises WorkflowNotFound and deletes nothing."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            await store.create(row("a"))
            put = await store.inbox_put("a", "go", None)
            with pytest.raises(WorkflowNotFound):
                await store.checkpoint("nope", status="Waiting", data="{}", state="{}",
                                       inbox_done=[put])  # fmt: skip
            assert [i.id for i in await store.inbox_pending()] == [put]

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

    async def test_set_status_and_add_history(self, tmp_path: Path) -> None:
        """set_status keeps data, keeps attempt when None, and both append history."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", '{"x":1}', "{}", attempt=3))
            await store.set_status("a", status="Failed", error="bad", history=[("failed", {})])
            await store.add_history("a", "note", {"k": [1, 2]})
            got = await store.get("a")
            assert got is not None
            assert (got.status, got.error, got.attempt, got.data) == ("Failed", "bad", 3, '{"x":1}')
            assert [h.kind for h in await store.history("a")] == ["failed", "note"]
            with pytest.raises(WorkflowNotFound):
                await store.set_status("nope", status="Failed")
            with pytest.raises(WorkflowNotFound):
                await store.add_history("nope", "note", {})

    async def test_history_retention(self, tmp_path: Path) -> None:
        """Only the newest history_keep entries per workflow are kept."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db, history_keep=5) as store:
            await store.create(row("a"), history=[("created", {})])
            await store.create(row("b"), history=[("created", {})])
            for i in range(12):
                await store.add_history("a", "note", {"i": i})
            await store.checkpoint("a", status="Waiting", data="{}", state="{}",
                                   history=[("step", {"i": 12}), ("step", {"i": 13})])  # fmt: skip
            assert [h.detail["i"] for h in await store.history("a")] == [9, 10, 11, 12, 13]
            assert [h.detail["i"] for h in await store.history("a", limit=2)] == [12, 13]
            assert len(await store.history("b")) == 1
        assert raw(db, "SELECT COUNT(*) FROM history WHERE workflow_id = 'a'") == [(5,)]


class TestGroupCommit:
    async def test_concurrent_checkpoints_share_commits(self, tmp_path: Path) -> None:
        """200 concurrent checkpoints commit in fewer transactions than writes."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            for i in range(200):
                await store.create(row(f"w{i}"))
            before = (store.stats.commits, store.stats.writes)

            async def save(i: int) -> None:
                await store.checkpoint(f"w{i}", status="Waiting", data=f'{{"i":{i}}}', state="{}",
                                       history=[("step", {"i": i})])  # fmt: skip

            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(save, i)
            commits = store.stats.commits - before[0]
            writes = store.stats.writes - before[1]
            assert writes == 200 and commits < writes
            assert (await store.counts()) == {"Waiting": 200}
            got = await store.get("w150")
            assert got is not None and got.data == '{"i":150}'

    async def test_unknown_id_fails_alone(self, tmp_path: Path) -> None:
        """One checkpoint for an unknown id fails; the rest of its batch commits."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            for i in range(50):
                await store.create(row(f"w{i}"))
            errors: list[BaseException] = []

            async def save(wid: str) -> None:
                try:
                    await store.checkpoint(wid, status="Waiting", data="{}", state="{}")
                except WorkflowNotFound as e:
                    errors.append(e)

            async with anyio.create_task_group() as tg:
                for wid in [
                    *(f"w{i}" for i in range(25)),
                    "ghost",
                    *(f"w{i}" for i in range(25, 50)),
                ]:
                    tg.start_soon(save, wid)
            assert [str(e) for e in errors] == ["no workflow 'ghost'"]
            assert store.stats.splits == 1
            assert (await store.counts()) == {"Waiting": 50}

    async def test_disk_full_fails_alone(self, tmp_path: Path) -> None:
        """A write that hits SQLITE_FULL fails alone; the small writes of its batch commit."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            for i in range(20):
                await store.create(row(f"w{i}"))
            ((pages,),) = await store._writer.execute_fetchall("PRAGMA page_count")
            await store._writer.execute(f"PRAGMA max_page_count = {pages}")
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
            await store._writer.execute("PRAGMA busy_timeout = 50")
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


class TestReads:
    async def test_inbox(self, tmp_path: Path) -> None:
        """Inbox rows come back oldest first, per workflow or all, until marked done."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            a1 = await store.inbox_put("a", "go", {"x": [1]}, thread_id="t", pc=4)
            b1 = await store.inbox_put("b", "stop", "now")
            a2 = await store.inbox_put("a", "go", None)
            pending = await store.inbox_pending()
            assert [(i.id, i.workflow_id, i.input) for i in pending] == [
                (a1, "a", {"x": [1]}), (b1, "b", "now"), (a2, "a", None),
            ]  # fmt: skip
            assert (pending[0].event, pending[0].thread_id, pending[0].pc) == ("go", "t", 4)
            assert [i.id for i in await store.inbox_pending("a")] == [a1, a2]
            await store.inbox_done([a1, b1])
            assert [i.id for i in await store.inbox_pending()] == [a2]

    async def test_list_get_counts(self, tmp_path: Path) -> None:
        """list filters by status and name, newest update first; counts groups by status."""
        with fake_clock() as clock:
            async with SQLiteStore.open(tmp_path / "wf.db") as store:
                for wid, status, name in [("a", "Waiting", "X"), ("b", "Finished", "X"),
                                          ("c", "Waiting", "Y")]:  # fmt: skip
                    clock.advance(1)
                    await store.create(row(wid, status, name))
                assert [r.id for r in await store.list()] == ["c", "b", "a"]
                assert [r.id for r in await store.list(status="Waiting")] == ["c", "a"]
                assert [r.id for r in await store.list(status="Waiting", name="X")] == ["a"]
                assert [r.id for r in await store.list(limit=1)] == ["c"]
                assert await store.counts() == {"Waiting": 2, "Finished": 1}
                assert await store.get("zzz") is None

    async def test_unfinished_streams_pages(self, tmp_path: Path) -> None:
        """unfinished yields every non-final row and reads later pages only when reached."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            for i in range(35):
                await store.create(row(f"w{i:02}", "Finished" if i % 5 == 0 else "Waiting"))
            seen = []
            async for r in store.unfinished(page=10):
                seen.append(r.id)
                if r.id == "w01":
                    await store.set_status("w34", status="Cancelled")
            assert seen == [f"w{i:02}" for i in range(34) if i % 5]

    async def test_delete_finished(self, tmp_path: Path) -> None:
        """Old workflows in a final status are deleted with their history and inbox."""
        db = tmp_path / "wf.db"
        with fake_clock(1000.0) as clock:
            async with SQLiteStore.open(db) as store:
                for wid, status in [("a", "Finished"), ("b", "Failed"), ("c", "Waiting")]:
                    await store.create(row(wid, status), history=[("created", {})])
                    await store.inbox_put(wid, "go", None)
                clock.advance(100)
                await store.create(row("d", "Cancelled"), history=[("created", {})])
                assert await store.delete_finished(older_than=1050.0) == 2
                assert sorted(r.id for r in await store.list()) == ["c", "d"]
                assert await store.history("a") == []
                assert [i.workflow_id for i in await store.inbox_pending()] == ["c"]
        assert raw(db, "SELECT DISTINCT workflow_id FROM history ORDER BY 1") == [("c",), ("d",)]


class TestParentsAndDeadlines:
    async def test_parent_and_deadline_are_stored_and_listed(self, tmp_path: Path) -> None:
        """A child's parent and a deadline survive a reopen; list keeps one parent's children."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            await store.create(row("p"))
            kid = row("p/kid/1")
            kid.parent, kid.deadline = "p", 1234.5
            await store.create(kid)
        async with SQLiteStore.open(db) as store:
            got = await store.get("p/kid/1")
            assert got is not None and (got.parent, got.deadline) == ("p", 1234.5)
            assert [r.id for r in await store.list(parent="p")] == ["p/kid/1"]
            assert await store.list(parent="p/kid/1") == []

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

    async def test_pages_cover_every_row_once_even_with_ties(self, tmp_path: Path) -> None:
        """Pages of 3 over rows sharing updated_at list each row once, newest first."""
        with fake_clock() as clock:
            async with SQLiteStore.open(tmp_path / "wf.db") as store:
                for n in range(10):
                    if n % 4 == 0:
                        clock.advance(1)  # the others share their time with a neighbour
                    await store.create(row(f"w{n}", "Waiting" if n % 2 else "Resuming"))
                seen, after, pages = [], None, 0
                while True:
                    rows, after = await store.page(limit=3, after=after)
                    seen += rows
                    pages += 1
                    if after is None:
                        break
                waiting, after = await store.page(status="Waiting", limit=10)
        assert [r.id for r in seen] == [f"w{n}" for n in reversed(range(10))]
        assert pages == 4
        assert [r.updated_at for r in seen] == sorted((r.updated_at for r in seen), reverse=True)
        assert [r.id for r in waiting] == ["w9", "w7", "w5", "w3", "w1"] and after is None

    async def test_a_row_changed_between_pages_is_not_listed_twice(self, tmp_path: Path) -> None:
        """A row listed on page 1 and changed before page 2 moves ahead; page 2 goes on."""
        with fake_clock() as clock:
            async with SQLiteStore.open(tmp_path / "wf.db") as store:
                for n in range(6):
                    clock.advance(1)
                    await store.create(row(f"w{n}", "Waiting"))
                first, after = await store.page(limit=3)
                clock.advance(1)
                await store.set_status("w5", status="Finished")  # listed on page 1, now newest
                rest, end = await store.page(limit=3, after=after)
        assert [r.id for r in first] == ["w5", "w4", "w3"]
        assert [r.id for r in rest] == ["w2", "w1", "w0"] and end is None
