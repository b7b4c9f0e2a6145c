"""Tests for daemon.store.walcheck: WAL checkpoints on their own thread, rung by the writer."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import anyio

from daemon.store.base import WorkflowRow
from daemon.store.sqlite import SQLiteStore
from daemon.store.walcheck import AUTOCHECKPOINT_PAGES, RING_EVERY, WalCheckpointer
from daemon.store.writer import GroupWriter
from tests.helpers.wait import until


def connect(db: Path) -> sqlite3.Connection:
    """Open a write connection as the store does, on a table `t`."""
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    conn.executescript("PRAGMA journal_mode = WAL; CREATE TABLE IF NOT EXISTS t (k INTEGER);")
    return conn


def insert(k: int) -> Callable[[sqlite3.Connection], None]:
    """Return a write that inserts `k`."""

    def apply(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO t VALUES (?)", (k,))

    return apply


def checkpointer_threads() -> list[threading.Thread]:
    """Return the live checkpointer threads of this process."""
    return [t for t in threading.enumerate() if t.name == "workflowd-walcheck"]


def rows_in_main_file(db: Path) -> int:
    """Count the history rows the database file itself holds, ignoring its WAL."""
    conn = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
    try:
        (n,) = conn.execute("SELECT COUNT(*) FROM history").fetchone()
        return int(n)
    finally:
        conn.close()


class TestRings:
    async def test_the_writer_rings_every_so_many_commits(self, tmp_path: Path) -> None:
        """A ring every `ring_every` commits; a batch of many writes counts for more."""
        rings: list[int] = []
        w = GroupWriter(
            connect(tmp_path / "w.db"),
            checkpoint=lambda: rings.append(1),
            ring_every=4,
            writes_per_commit=8,
        )
        w.start()
        try:
            for k in range(8):  # one commit each: the writer is idle between them
                await w.submit(insert(k))
            assert len(rings) == 2
            async with anyio.create_task_group() as tg:  # 40 writes: few commits, 5+ counts
                for k in range(40):
                    tg.start_soon(w.submit, insert(k))
            assert w.stats.commits < 48  # the 40 were batched
            assert len(rings) >= 3
        finally:
            await w.close()

    async def test_no_ring_no_checkpoint(self, tmp_path: Path) -> None:
        """An unrung checkpointer runs nothing; a ring runs one; close ends its thread."""
        ck = WalCheckpointer(connect(tmp_path / "w.db"))
        ck.start()
        await w_commits(tmp_path / "w.db", 3)
        assert ck.checkpoints == 0
        ck.ring()
        ck.ring()  # rung twice before it ran: merged, or run twice; never an error
        await until(lambda: ck.checkpoints >= 1)
        await anyio.to_thread.run_sync(ck.close)
        assert not checkpointer_threads()

    async def test_a_failing_checkpoint_is_counted_and_the_thread_goes_on(
        self, tmp_path: Path
    ) -> None:
        """A checkpoint that raises is counted (and logged once); the next ring tries again."""
        conn = connect(tmp_path / "w.db")
        ck = WalCheckpointer(conn)
        conn.close()  # every statement now raises ProgrammingError (a sqlite3.Error)
        ck.start()
        ck.ring()
        await until(lambda: ck.failures >= 1)
        ck.ring()
        await until(lambda: ck.failures >= 2)
        assert ck.checkpoints == 0
        await anyio.to_thread.run_sync(ck.close)
        assert not checkpointer_threads()

    async def test_truncate_empties_the_wal_file(self, tmp_path: Path) -> None:
        """A TRUNCATE checkpoint copies the WAL into the file and gives its room back."""
        wal = tmp_path / "w.db-wal"
        ck = WalCheckpointer(connect(tmp_path / "w.db"))  # open: the WAL outlives the writer
        ck.start()
        try:
            await w_commits(tmp_path / "w.db", 3)
            assert wal.stat().st_size > 0
            ck.truncate()
            await until(lambda: ck.checkpoints >= 1 and wal.stat().st_size == 0)
        finally:
            await anyio.to_thread.run_sync(ck.close)

    async def test_close_before_start_closes_the_connection(self, tmp_path: Path) -> None:
        """A checkpointer that never ran still closes its connection."""
        conn = connect(tmp_path / "w.db")
        WalCheckpointer(conn).close()
        try:
            conn.execute("SELECT 1")
        except sqlite3.ProgrammingError:
            return
        raise AssertionError("the connection is still open")


async def w_commits(db: Path, n: int) -> None:
    """Commit `n` writes on a writer of its own, one at a time."""
    w = GroupWriter(connect(db))
    w.start()
    try:
        for k in range(n):
            await w.submit(insert(k))
    finally:
        await w.close()


class TestStore:
    async def test_commits_leave_the_wal_to_the_checkpointer(self, tmp_path: Path) -> None:
        """The writer's own automatic checkpoint is only a far safety net."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            row = await store._writes.call(
                lambda conn: conn.execute("PRAGMA wal_autocheckpoint").fetchone()
            )
            assert row[0] == AUTOCHECKPOINT_PAGES > 1000  # SQLite's default: 1000 pages
            assert store.checkpointer is not None
            assert len(checkpointer_threads()) == 1
        assert not checkpointer_threads()

    async def test_the_checkpointer_copies_commits_into_the_file(self, tmp_path: Path) -> None:
        """After RING_EVERY commits the WAL's pages reach the database file, off the writer."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            ck = store.checkpointer
            assert ck is not None
            await store.create(WorkflowRow("w", "Bench", "Resuming", "{}", "{}"))
            for i in range(RING_EVERY + 1):
                await store.checkpoint(
                    "w", status="Resuming", data="{}", state="{}", history=[("step", {"i": i})]
                )
            await until(lambda: ck.checkpoints >= 1)

            def copied() -> bool:
                if rows_in_main_file(db) > 0:
                    return True
                ck.ring()
                return False

            # A PASSIVE checkpoint copies only what it can at once (it waits for nobody): rung
            # again until the rows are in the file, as the writer's next commits would.
            await until(copied)
            assert ck.failures == 0
