"""Tests for the checkpoint's flat path: one statement per checkpoint, its own transaction alone."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import WorkflowNotFound
from daemon.store import schema
from daemon.store.base import WorkflowRow
from daemon.store.sqlite import SQLiteStore

CEILING_S = 10.0


async def batched(store: SQLiteStore, *writes: Awaitable[Any]) -> list[Any]:
    """Run `writes` as one batch (queued while the writer is held); return their outcomes."""
    release = threading.Event()
    blocker = asyncio.ensure_future(store._writes.call(lambda conn: release.wait(CEILING_S)))
    await asyncio.sleep(0)
    futures = [asyncio.ensure_future(w) for w in writes]
    await asyncio.sleep(0)
    commits = store.stats.commits
    release.set()
    await blocker
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    assert store.stats.commits - commits <= len(writes)
    return outcomes


def save(store: SQLiteStore, wid: str, n: int, history: int = 1) -> Awaitable[None]:
    """Checkpoint `wid` with data n and `history` entries."""
    return store.checkpoint(
        wid,
        status="Waiting",
        data=f'{{"n":{n}}}',
        state=f'{{"pc":{n}}}',
        history=[("step", {"n": n, "i": i}) for i in range(history)],
    )


async def seqs(store: SQLiteStore, wid: str) -> list[tuple[int, int]]:
    """Return (n, i) of each history row of `wid`, in order."""
    return [(h.detail["n"], h.detail["i"]) for h in await store.history(wid)]


class TestFlat:
    async def test_a_lone_checkpoint_is_one_statement_and_durable(self, tmp_path: Path) -> None:
        """No BEGIN and COMMIT around it, and another connection sees it once it returns."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", "{}", "{}"))
            traced: list[str] = []
            await store._writes.call(lambda conn: conn.set_trace_callback(traced.append))
            await save(store, "a", 7)
            await store._writes.call(lambda conn: conn.set_trace_callback(None))
            # Each statement of the trigger is traced as the statement that runs it.
            assert traced and all(s.startswith("INSERT INTO temp.wd_checkpoint") for s in traced)
            assert not await store._writes.call(lambda conn: conn.in_transaction)
            other = sqlite3.connect(db)
            try:
                row = other.execute("SELECT data, state, history_seq FROM workflows").fetchone()
                assert row == ('{"n":7}', '{"pc":7}', 1)
            finally:
                other.close()
            assert await seqs(store, "a") == [(7, 0)]

    async def test_a_missing_workflow_fails_alone_and_changes_nothing(self, tmp_path: Path) -> None:
        """Alone: WorkflowNotFound naming it. In a batch: the others are committed."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            with pytest.raises(WorkflowNotFound, match="'nope'"):
                await save(store, "nope", 1)
            for wid in ("a", "b"):
                await store.create(WorkflowRow(wid, "Demo", "Resuming", "{}", "{}"))
            a, missing, b = await batched(
                store, save(store, "a", 1), save(store, "nope", 2), save(store, "b", 3)
            )
            assert a is None and b is None
            assert isinstance(missing, WorkflowNotFound) and "'nope'" in str(missing)
            assert await seqs(store, "a") == [(1, 0)] and await seqs(store, "b") == [(3, 0)]
            assert await store.get("nope") is None
            assert await store.history("nope") == []

    async def test_flat_and_general_checkpoints_in_one_batch_keep_their_order(
        self, tmp_path: Path
    ) -> None:
        """Runs of the flat path between general ones: data last, history in order, trimmed."""
        async with SQLiteStore.open(tmp_path / "wf.db", history_keep=4) as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", "{}", "{}"))
            outcomes = await batched(
                store,
                save(store, "a", 1),
                save(store, "a", 2, history=2),  # the general path
                save(store, "a", 3),
                save(store, "a", 4, history=0),
                save(store, "a", 5),
            )
            assert outcomes == [None] * 5
            got = await store.get("a")
            assert got is not None and got.data == '{"n":5}' and got.status == "Waiting"
            # five rows written (1, 2, 2, 3, 5), the oldest trimmed past history_keep
            assert await seqs(store, "a") == [(2, 0), (2, 1), (3, 0), (5, 0)]

    async def test_history_is_trimmed_past_keep_every_trim_every_rows(self, tmp_path: Path) -> None:
        """The trigger trims when the counter reaches a multiple of HISTORY_TRIM_EVERY.

        Reads show the newest history_keep rows after every checkpoint; the file holds at
        most HISTORY_TRIM_EVERY - 1 rows more, and exactly history_keep right after a trim.
        """
        every = schema.HISTORY_TRIM_EVERY
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db, history_keep=3) as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", "{}", "{}"))
            conn = sqlite3.connect(db)
            try:
                for n in range(1, 2 * every + 5):
                    await save(store, "a", n)
                    assert await seqs(store, "a") == [(m, 0) for m in range(max(1, n - 2), n + 1)]
                    stored = [s for (s,) in conn.execute("SELECT seq FROM history ORDER BY seq")]
                    # the counter is n; rows up to the last multiple of `every`, less 3, are gone
                    first = max(1, (n // every) * every - 2)
                    assert stored == list(range(first, n + 1))
                    assert len(stored) <= 3 + every - 1
            finally:
                conn.close()
            assert len(await store.history("a", limit=2)) == 2
            assert len(await store.history("a", limit=10_000)) == 3

    async def test_a_general_checkpoint_trims_what_the_flat_path_left(self, tmp_path: Path) -> None:
        """A checkpoint of several history rows trims to history_keep exactly, as before."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db, history_keep=3) as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", "{}", "{}"))
            for n in range(1, 8):
                await save(store, "a", n)
            await save(store, "a", 8, history=2)  # the general path
            conn = sqlite3.connect(db)
            try:
                stored = [s for (s,) in conn.execute("SELECT seq FROM history ORDER BY seq")]
            finally:
                conn.close()
            assert stored == [7, 8, 9]
            assert await seqs(store, "a") == [(7, 0), (8, 0), (8, 1)]

    async def test_an_end_on_the_flat_path_queues_its_hook_row(self, tmp_path: Path) -> None:
        """The status trigger fires from inside the checkpoint's trigger: the ending is queued."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", "{}", "{}"))
            await store.checkpoint("a", status="Finished", data="{}", state="{}")
        conn = sqlite3.connect(db)
        try:
            rows = conn.execute("SELECT workflow_id, workflow, status FROM hook_runs").fetchall()
        finally:
            conn.close()
        assert rows == [("a", "Demo", "Finished")]
