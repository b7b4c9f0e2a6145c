"""Tests for daemon.store.writer: the writer thread, its batches and its wake-ups."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from daemon.errors import Unavailable, WorkflowNotFound
from daemon.store.base import WorkflowRow
from daemon.store.sqlite import SQLiteStore
from daemon.store.writer import GroupWriter, statement
from tests.helpers.wait import until

CEILING_S = 10.0


class Counting(sqlite3.Connection):
    """A connection that counts the statements it is given, by call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        """Count one execute."""
        self.calls.append(("execute", sql))
        return super().execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        """Count one executemany."""
        self.calls.append(("executemany", sql))
        return super().executemany(sql, *args)


def connect(db: Path) -> Counting:
    """Open a write connection as the store does, counting its statements."""
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False, factory=Counting)
    assert isinstance(conn, Counting)
    conn.executescript("PRAGMA journal_mode = WAL; CREATE TABLE IF NOT EXISTS t (k INTEGER);")
    return conn


@asynccontextmanager
async def writer(db: Path) -> AsyncIterator[tuple[GroupWriter, Counting]]:
    """Run a GroupWriter on a fresh counting connection; close it on exit."""
    conn = connect(db)
    w = GroupWriter(conn)
    w.start()
    try:
        yield w, conn
    finally:
        await w.close()


def committed(db: Path) -> int:
    """Count the rows another connection sees committed in `t`."""
    conn = sqlite3.connect(db)
    try:
        (n,) = conn.execute("SELECT COUNT(*) FROM t").fetchone()
        return int(n)
    finally:
        conn.close()


def insert(k: int) -> Callable[[sqlite3.Connection], None]:
    """Return a write that inserts `k`."""

    def apply(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO t VALUES (?)", (k,))

    return apply


class TestThread:
    async def test_one_wake_per_batch(self, tmp_path: Path) -> None:
        """200 concurrent writes reach the loop with one wake-up per batch at most."""
        async with writer(tmp_path / "w.db") as (w, _):
            async with anyio.create_task_group() as tg:
                for k in range(200):
                    tg.start_soon(w.submit, insert(k))
            assert w.stats.writes == 200 and w.stats.splits == 0
            # batches the loop was late for: shared
            assert 1 <= w.stats.hand_backs <= w.stats.commits < 200
        assert committed(tmp_path / "w.db") == 200

    async def test_batches_committed_while_the_loop_is_busy_share_one_wake(
        self, tmp_path: Path
    ) -> None:
        """Batches committed before the loop takes the first reach it with that one wake-up."""
        db = tmp_path / "w.db"
        async with writer(db) as (w, _):
            await w.submit(insert(-1))  # the thread has started and posted once
            before = w.stats.hand_backs
            # A write that runs alone ends a batch: ten batches, taken one after another.
            waiters = []
            for k in range(10):
                waiters.append(asyncio.ensure_future(w.submit(insert(k))))
                waiters.append(asyncio.ensure_future(w.call(lambda _: None)))
            await asyncio.sleep(0)  # each waiter queues its write
            deadline = time.monotonic() + CEILING_S
            # Blocking the loop on purpose, until all 20 batches are done and posted.
            while len(w._posts) < 20 and time.monotonic() < deadline:
                time.sleep(0.005)  # noqa: ASYNC251 - the point is that the loop does not run
            assert committed(db) == 11
            await asyncio.gather(*waiters)
            assert w.stats.hand_backs == before + 1
            assert w.stats.writes == 11

    async def test_commits_while_the_loop_is_blocked(self, tmp_path: Path) -> None:
        """Writes queued before the loop blocks are committed meanwhile: batches need no loop turn."""
        db = tmp_path / "w.db"
        async with writer(db) as (w, _):
            waiters = [asyncio.ensure_future(w.submit(insert(k))) for k in range(50)]
            await asyncio.sleep(0)  # each waiter queues its write
            deadline = time.monotonic() + CEILING_S
            # Blocking the loop on purpose: the thread alone must get the rows committed.
            while committed(db) < 50 and time.monotonic() < deadline:
                time.sleep(0.005)  # noqa: ASYNC251 - the point is that the loop does not run
            assert committed(db) == 50
            await asyncio.gather(*waiters)

    async def test_waiter_wakes_after_commit(self, tmp_path: Path) -> None:
        """When a write's waiter wakes, another connection already sees the write."""
        db = tmp_path / "w.db"
        async with writer(db) as (w, _):
            for k in range(20):
                await w.submit(insert(k))
                assert committed(db) == k + 1

    async def test_cancelled_waiter_neither_loses_nor_doubles(self, tmp_path: Path) -> None:
        """A write whose waiter is cancelled after queueing it is committed exactly once."""
        db = tmp_path / "w.db"
        async with writer(db) as (w, _):
            release = threading.Event()
            blocker = asyncio.ensure_future(w.submit(lambda conn: release.wait(CEILING_S)))
            await asyncio.sleep(0)
            victim = asyncio.ensure_future(w.submit(insert(7)))
            await asyncio.sleep(0)
            victim.cancel()
            release.set()
            await blocker
            await w.submit(insert(8))
            assert victim.cancelled()
        assert committed(db) == 2

    async def test_runs_of_one_kind_share_one_executemany(self, tmp_path: Path) -> None:
        """Neighbouring writes made with the same ApplyMany go through one executemany."""
        drop = statement("DELETE FROM t WHERE k = ?")
        async with writer(tmp_path / "w.db") as (w, conn):
            for k in range(30):
                await w.submit(insert(k))
            release = threading.Event()
            blocker = asyncio.ensure_future(w.submit(lambda conn: release.wait(CEILING_S)))
            await asyncio.sleep(0)
            conn.calls.clear()  # the thread is held in the blocker: nothing else runs
            drops = [asyncio.ensure_future(w.submit_many(drop, [(k,)])) for k in range(30)]
            await asyncio.sleep(0)
            release.set()
            await blocker
            await asyncio.gather(*drops)
            many = [c for c in conn.calls if c[0] == "executemany"]
            assert many == [("executemany", "DELETE FROM t WHERE k = ?")]
        assert committed(tmp_path / "w.db") == 0

    async def test_checkpoints_put_in_one_loop_turn_wake_the_thread_once(
        self, tmp_path: Path
    ) -> None:
        """The idle thread is rung once the turn that put them is over: one batch, one commit."""
        drop = statement("DELETE FROM t WHERE k = ?")
        async with writer(tmp_path / "w.db") as (w, conn):
            await until(lambda: w._idle, CEILING_S)
            wakes, conn.calls[:] = w.stats.wakes, []
            puts = [w.put_many(drop, [(k,)]) for k in range(20)]
            time.sleep(0.05)  # noqa: ASYNC251 - a turn that goes on while the thread could run
            assert conn.calls == [] and w.stats.wakes == wakes
            for put in puts:
                await put
            assert w.stats.wakes == wakes + 1
            assert [c for c in conn.calls if c[0] == "executemany"] == [
                ("executemany", "DELETE FROM t WHERE k = ?")
            ]

    async def test_a_crash_is_reported_and_the_writer_goes_on(self, tmp_path: Path) -> None:
        """A write that kills its batch (a BaseException) fails with Unavailable, logged; the
        thread serves the next write."""

        class Boom(BaseException):
            """Not an Exception: gets past every per-write handler."""

        def boom(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO t VALUES (99)")
            raise Boom("kaput")

        db = tmp_path / "w.db"
        with structlog.testing.capture_logs() as logs:
            async with writer(db) as (w, _):
                with pytest.raises(Unavailable, match=r"writer crashed \(Boom: kaput\)"):
                    await w.submit(boom)
                await w.submit(insert(1))
        assert committed(db) == 1  # the crashed batch was rolled back
        crashed = [e for e in logs if e["event"] == "store_writer_crashed"]
        assert len(crashed) == 1 and crashed[0]["log_level"] == "error"
        assert crashed[0]["error"] == "Boom: kaput"

    async def test_close_leaves_no_pipe_open(self, tmp_path: Path) -> None:
        """The pipe the thread wakes the loop with is closed once the writer stopped."""
        before = set(os.listdir("/proc/self/fd"))
        for _ in range(5):
            async with writer(tmp_path / "w.db") as (w, _):
                await w.submit(insert(1))
        assert set(os.listdir("/proc/self/fd")) <= before

    async def test_close_drains_and_joins(self, tmp_path: Path) -> None:
        """close() commits what is queued, ends the thread and refuses new writes."""
        db = tmp_path / "w.db"
        async with writer(db) as (w, _):
            waiters = [asyncio.ensure_future(w.submit(insert(k))) for k in range(40)]
            await asyncio.sleep(0)
            await w.close()
            assert w._thread is not None and not w._thread.is_alive()
            assert w.closed
            await asyncio.gather(*waiters)
            with pytest.raises(Unavailable):
                await w.submit(insert(0))
        assert committed(db) == 40

    async def test_a_refused_batch_fails_whole_and_begins_nothing(self, tmp_path: Path) -> None:
        """A refusal fails every write of the batch with it; later batches are asked again."""
        # Refused until told otherwise: the two writes fail however they are batched.
        refusing = [True]
        full = sqlite3.OperationalError("full")
        conn = connect(tmp_path / "w.db")
        w = GroupWriter(conn, refusal=lambda: full if refusing[0] else None)
        w.start()
        try:
            outcomes = await asyncio.gather(
                w.submit(insert(1)), w.submit(insert(2)), return_exceptions=True
            )
            assert [str(o) for o in outcomes] == ["full", "full"]
            assert not any(call[1].startswith("BEGIN") for call in conn.calls)
            refusing[0] = False
            await w.submit(insert(3))
        finally:
            await w.close()
        assert committed(tmp_path / "w.db") == 1
        assert (w.stats.commits, w.stats.writes) == (1, 1)

    async def test_call_runs_outside_a_transaction(self, tmp_path: Path) -> None:
        """call() runs alone, between batches, with no transaction open."""
        async with writer(tmp_path / "w.db") as (w, _):
            assert not await w.call(lambda conn: conn.in_transaction)
            assert await w.submit(lambda conn: conn.in_transaction)


async def pragma(store: SQLiteStore, text: str) -> object:
    """Run `PRAGMA text` on the store's write connection and return its first value."""
    row = await store._writes.call(lambda conn: conn.execute(f"PRAGMA {text}").fetchone())
    return None if row is None else row[0]


class TestStore:
    @pytest.mark.parametrize(("synchronous", "level"), [("normal", 1), ("full", 2)])
    async def test_writer_connection_pragmas(
        self, tmp_path: Path, synchronous: str, level: int
    ) -> None:
        """The writer thread's connection has WAL, the busy timeout and the configured level."""
        async with SQLiteStore.open(tmp_path / "wf.db", synchronous=synchronous) as store:
            assert await pragma(store, "journal_mode") == "wal"
            assert await pragma(store, "busy_timeout") == 5000
            assert await pragma(store, "synchronous") == level

    async def test_a_workflow_saved_twice_in_one_batch(self, tmp_path: Path) -> None:
        """Two checkpoints of one workflow in one batch keep their order: data and history."""
        async with SQLiteStore.open(tmp_path / "wf.db", history_keep=3) as store:
            for wid in ("a", "b"):
                await store.create(WorkflowRow(wid, "Demo", "Resuming", "{}", "{}"))
            release = threading.Event()
            blocker = asyncio.ensure_future(
                store._writes.call(lambda conn: release.wait(CEILING_S))
            )
            await asyncio.sleep(0)
            history = [("step", {"n": n}) for n in range(5)]
            saves = [
                asyncio.ensure_future(
                    store.checkpoint(
                        wid,
                        status="Waiting",
                        data=f'{{"n":{n}}}',
                        state="{}",
                        history=[history[n], ("note", {"n": n})],
                    )
                )
                for n, wid in enumerate(["a", "b", "a", "a", "b"])
            ]
            await asyncio.sleep(0)
            commits = store.stats.commits
            release.set()
            await blocker
            await asyncio.gather(*saves)
            assert store.stats.commits == commits + 1 and store.stats.splits == 0
            a, b = await store.get("a"), await store.get("b")
            assert a is not None and a.data == '{"n":3}'
            assert b is not None and b.data == '{"n":4}'
            assert [(h.kind, h.detail["n"]) for h in await store.history("a")] == [
                ("note", 2), ("step", 3), ("note", 3),
            ]  # fmt: skip
            assert [h.detail["n"] for h in await store.history("b")] == [1, 4, 4]

    async def test_inbox_puts_in_one_batch_get_their_own_ids(self, tmp_path: Path) -> None:
        """Callbacks recorded together (one executemany) each get the id of their own row."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            await store.inbox_put("a", "warm", None)  # ids go on from the rows before
            release = threading.Event()
            blocker = asyncio.ensure_future(
                store._writes.call(lambda conn: release.wait(CEILING_S))
            )
            await asyncio.sleep(0)
            puts = [
                asyncio.ensure_future(store.inbox_put(f"w{i % 3}", "go", {"i": i}))
                for i in range(30)
            ]
            await asyncio.sleep(0)
            commits = store.stats.commits
            release.set()
            await blocker
            ids = await asyncio.gather(*puts)
            assert store.stats.commits == commits + 1
            pending = {row.id: row for row in await store.inbox_pending()}
            for i, inbox_id in enumerate(ids):
                got = pending[inbox_id]
                assert (got.workflow_id, got.input) == (f"w{i % 3}", {"i": i})
            assert len(set(ids)) == 30

    async def test_a_batch_of_many_workflows(self, tmp_path: Path) -> None:
        """1,200 checkpoints in one batch (past SQLite's bound-parameter limit) all land."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            for i in range(1200):
                await store.create(WorkflowRow(f"w{i}", "Demo", "Resuming", "{}", "{}"))
            release = threading.Event()
            blocker = asyncio.ensure_future(
                store._writes.call(lambda conn: release.wait(CEILING_S))
            )
            await asyncio.sleep(0)
            saves = [
                asyncio.ensure_future(
                    store.checkpoint(
                        f"w{i}", status="Waiting", data="{}", state="{}", history=[("step", {})]
                    )
                )
                for i in range(1200)
            ]
            await asyncio.sleep(0)
            commits = store.stats.commits
            release.set()
            await blocker
            await asyncio.gather(*saves)
            assert store.stats.commits == commits + 1
            assert await store.counts() == {"Waiting": 1200}
            assert [h.kind for h in await store.history("w1199")] == ["step"]

    async def test_creates_in_one_batch(self, tmp_path: Path) -> None:
        """Creates committed together: a taken id, or the second of two creates of one id, is
        left as it is and answers False; the others' history is numbered from 1 and trimmed."""
        async with SQLiteStore.open(tmp_path / "wf.db", history_keep=2) as store:
            await store.create(WorkflowRow("old", "Demo", "Finished", '{"v":"old"}', "{}"))
            release = threading.Event()
            blocker = asyncio.ensure_future(
                store._writes.call(lambda conn: release.wait(CEILING_S))
            )
            await asyncio.sleep(0)
            history = [("created", {"n": 0}), ("note", {"n": 1}), ("note", {"n": 2})]
            wids = ["a", "old", "b", "a", "c"]
            creates = [
                asyncio.ensure_future(
                    store.create(
                        WorkflowRow(wid, "Demo", "Resuming", f'{{"v":{n}}}', "{}"), history
                    )
                )
                for n, wid in enumerate(wids)
            ]
            await asyncio.sleep(0)
            commits = store.stats.commits
            release.set()
            await blocker
            assert await asyncio.gather(*creates) == [True, False, True, False, True]
            assert store.stats.commits == commits + 1 and store.stats.splits == 0
            rows = [await store.get(w) for w in ("a", "old", "b", "c")]
            assert [r.data for r in rows if r is not None] == [
                '{"v":0}', '{"v":"old"}', '{"v":2}', '{"v":4}',
            ]  # fmt: skip
            for wid in ("a", "b", "c"):
                # Three entries, two kept: numbered 1..3 and trimmed as one create alone would.
                assert [h.detail["n"] for h in await store.history(wid)] == [1, 2]
            assert await store.history("old") == []

    async def test_a_cancelled_checkpoint_is_written_once_and_its_batch_goes_on(
        self, tmp_path: Path
    ) -> None:
        """A checkpoint whose caller is cancelled once queued is committed exactly once; the
        checkpoints around it in its batch commit and wake their callers."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", "{}", "{}"))
            release = threading.Event()
            blocker = asyncio.ensure_future(
                store._writes.call(lambda conn: release.wait(CEILING_S))
            )
            await asyncio.sleep(0)
            saves = [
                asyncio.ensure_future(
                    store.checkpoint(
                        "a",
                        status="Waiting",
                        data=f'{{"n":{n}}}',
                        state="{}",
                        history=[("step", {"n": n})],
                    )
                )
                for n in range(3)
            ]
            await asyncio.sleep(0)
            saves[1].cancel()
            commits = store.stats.commits
            release.set()
            await blocker
            await asyncio.gather(saves[0], saves[2])
            assert saves[1].cancelled()
            assert store.stats.commits == commits + 1 and store.stats.writes >= 3
            got = await store.get("a")
            assert got is not None and got.data == '{"n":2}'
            assert [h.detail["n"] for h in await store.history("a")] == [0, 1, 2]

    async def test_each_write_of_a_failed_batch_gets_its_own_outcome(self, tmp_path: Path) -> None:
        """In a batch that fails, the checkpoint of a missing workflow raises; the others
        commit (the batch is split) and their callers wake without an error."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            for wid in ("a", "c"):
                await store.create(WorkflowRow(wid, "Demo", "Resuming", "{}", "{}"))
            release = threading.Event()
            blocker = asyncio.ensure_future(
                store._writes.call(lambda conn: release.wait(CEILING_S))
            )
            await asyncio.sleep(0)
            saves = [
                asyncio.ensure_future(
                    store.checkpoint(wid, status="Waiting", data='{"n":1}', state="{}")
                )
                for wid in ("a", "missing", "c")
            ]
            await asyncio.sleep(0)
            release.set()
            await blocker
            outcomes = await asyncio.gather(*saves, return_exceptions=True)
            assert outcomes[0] is None and outcomes[2] is None
            assert isinstance(outcomes[1], WorkflowNotFound) and "missing" in str(outcomes[1])
            assert store.stats.splits == 1
            for wid in ("a", "c"):
                got = await store.get(wid)
                assert got is not None and got.data == '{"n":1}'
            assert await store.get("missing") is None

    async def test_an_idle_writer_is_woken_by_each_lone_write(self, tmp_path: Path) -> None:
        """Writes that each find the thread idle wake it, and each is committed before its
        caller wakes: none waits for a later write to ring the bell."""
        db = tmp_path / "w.db"
        async with writer(db) as (w, _):
            for k in range(30):
                await until(lambda: w._idle, CEILING_S)  # the thread sleeps on its bell
                await w.submit(insert(k))
                assert committed(db) == k + 1
            assert w.stats.wakes >= 30
