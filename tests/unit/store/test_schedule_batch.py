"""`schedule_fire_many` on every backend: many fires, one transaction, all or nothing."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import anyio
import pytest

from daemon.errors import ScheduleNotFound
from daemon.store import schema
from daemon.store.base import FireRecord, ScheduleFire, WorkflowRow
from daemon.store.postgres import PostgresStore
from daemon.store.sqlite import TRIM_EVERY, SQLiteStore
from tests.helpers.wait import until

CEILING_S = 10.0
AnyStore = SQLiteStore | PostgresStore
Opener = Callable[[], AbstractAsyncContextManager[AnyStore]]


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Open one fresh database of the backend under test."""
    if request.param == "sqlite":
        return lambda: SQLiteStore.open(tmp_path / "wf.db")
    dsn: str = request.getfixturevalue("pg_dsn")
    return lambda: PostgresStore.open(dsn)


def fire(name: str, nominal: float, *, wid: str | None = None) -> ScheduleFire:
    """Build the fire of schedule `name` at `nominal`, starting a Demo workflow."""
    wid = wid or f"{name}:{nominal}"
    row = WorkflowRow(id=wid, name="Demo", status="Resuming", data="{}", state="{}")
    return ScheduleFire(
        name,
        row,
        [("started", {"schedule": name})],
        last_nominal=nominal,
        records=[FireRecord(0.0, "fired", nominal=nominal, workflow_id=wid)],
    )


async def test_fires_commit_together(opener: Opener) -> None:
    """Each fire creates its workflow and history, advances its schedule and keeps its record."""
    async with opener() as store:
        await store.schedules_load(["a", "b", "c"], 100.0)
        got = await store.schedule_fire_many([fire("a", 101), fire("b", 101), fire("c", 102)])
        assert got == [True, True, True]
        rows = {r.name: r for r in await store.schedules_load(["a", "b", "c"], 100.0)}
        assert {n: (r.last_nominal, r.last_workflow_id) for n, r in rows.items()} == {
            "a": (101, "a:101"), "b": (101, "b:101"), "c": (102, "c:102")
        }  # fmt: skip
        assert [h.kind for h in await store.history("c:102")] == ["started"]
        (record,) = await store.schedule_fires("c")
        assert (record.kind, record.nominal, record.workflow_id) == ("fired", 102, "c:102")
        assert record.at > 0.0  # stamped as the transaction was written, not the caller's 0


async def test_an_existing_id_still_advances(opener: Opener) -> None:
    """A fire whose workflow exists (a retry after a crash) leaves it and moves the schedule."""
    async with opener() as store:
        await store.schedules_load(["a", "b"], 100.0)
        assert await store.schedule_fire_many([fire("a", 101)]) == [True]
        again = [fire("a", 102, wid="a:101"), fire("b", 101)]
        assert await store.schedule_fire_many(again) == [False, True]
        (a,) = await store.schedules_load(["a"], 100.0)
        assert a.last_nominal == 102
        assert [h.kind for h in await store.history("a:101")] == ["started"]  # not doubled


async def test_one_bad_fire_writes_nothing(opener: Opener) -> None:
    """A fire of an unknown schedule fails the batch: no workflow and no advance is kept."""
    async with opener() as store:
        await store.schedules_load(["a"], 100.0)
        with pytest.raises(ScheduleNotFound):
            await store.schedule_fire_many([fire("a", 101), fire("ghost", 101)])
        assert await store.get("a:101") is None
        (a,) = await store.schedules_load(["a"], 100.0)
        assert a.last_nominal == 100.0 and await store.schedule_fires("a") == []


async def test_old_records_are_trimmed(opener: Opener) -> None:
    """Past FIRES_KEPT records a schedule's oldest are dropped, as one fire at a time does."""
    async with opener() as store:
        await store.schedules_load(["a"], 0.0)
        for k in range(1, schema.FIRES_KEPT + 2 * TRIM_EVERY + 1):
            await store.schedule_fire_many([fire("a", k)])
        kept = await store.schedule_fires("a", limit=1000)
        assert schema.FIRES_KEPT <= len(kept) < schema.FIRES_KEPT + TRIM_EVERY
        assert kept[-1].nominal == schema.FIRES_KEPT + 2 * TRIM_EVERY


async def test_rows_keep_their_values_exactly(opener: Opener) -> None:
    """Text with quotes, escapes and non-ASCII, and times that are not whole, are written as
    given (SQLite takes the batch as JSON: nothing may be rounded or re-escaped)."""
    async with opener() as store:
        await store.schedules_load(["x"], 100.0)
        nominal = 2520917141 * 0.7  # not a whole number, nor one JSON text shows short
        f = fire("x", nominal, wid='x:"ünï"\\\x01')
        f.row.data = '{"label": "qu\\"ote ✓ \\u0001"}'
        f.row.state = '{"id": "x:\\"ünï\\"\\\\\\u0001"}'
        f.row.deadline = nominal + 0.123456789
        f.history[0][1]["note"] = "tab\there ✓"
        assert await store.schedule_fire_many([f]) == [True]
        row = await store.get(f.row.id)
        assert row is not None
        assert (row.data, row.state, row.deadline) == (f.row.data, f.row.state, f.row.deadline)
        assert row.created_at > 0.0 and row.created_at == row.updated_at
        (x,) = await store.schedules_load(["x"], 100.0)
        assert (x.last_nominal, x.last_workflow_id) == (nominal, f.row.id)
        (record,) = await store.schedule_fires("x")
        assert (record.nominal, record.workflow_id) == (nominal, f.row.id)
        (h,) = await store.history(f.row.id)
        assert h.detail == {"schedule": "x", "note": "tab\there ✓"}


async def test_two_fires_of_one_id_in_a_batch(opener: Opener) -> None:
    """Of two fires of one id in a batch the first creates it; both schedules advance."""
    async with opener() as store:
        await store.schedules_load(["a", "b"], 100.0)
        got = await store.schedule_fire_many([fire("a", 101, wid="w"), fire("b", 101, wid="w")])
        assert got == [True, False]
        assert [h.kind for h in await store.history("w")] == ["started"]
        rows = await store.schedules_load(["a", "b"], 100.0)
        assert [(r.last_nominal, r.last_workflow_id) for r in rows] == [(101, "w")] * 2


async def test_a_buffered_fire_clears_its_buffer(opener: Opener) -> None:
    """A fire that starts the buffered one clears it and leaves `last_nominal` as it was."""
    async with opener() as store:
        await store.schedules_load(["a"], 100.0)
        await store.schedule_note("a", last_nominal=105.0, buffered=104.0)
        f = fire("a", 104, wid="a:104")
        f = ScheduleFire(f.name, f.row, f.history, clear_buffered=True, records=f.records)
        assert await store.schedule_fire_many([f]) == [True]
        (a,) = await store.schedules_load(["a"], 100.0)
        assert (a.last_nominal, a.buffered, a.last_workflow_id) == (105.0, None, "a:104")


async def test_fires_go_ahead_of_the_writes_waiting(tmp_path: Path) -> None:
    """A batch of fires queued behind other writes is applied before them (the runs it
    started must not make the next fires late); the write being committed still ends first."""
    async with SQLiteStore.open(tmp_path / "wf.db") as store:
        await store.schedules_load(["a"], 100.0)
        began, release = threading.Event(), threading.Event()

        def hold(conn: sqlite3.Connection) -> None:
            began.set()
            release.wait(CEILING_S)

        async with anyio.create_task_group() as tg:
            tg.start_soon(store._writes.submit, hold)
            await anyio.to_thread.run_sync(began.wait, CEILING_S)
            later = WorkflowRow(id="plain", name="Demo", status="Resuming", data="{}", state="{}")
            tg.start_soon(store.create, later, [("started", {})])
            await until(lambda: len(store._writes._queue) == 1)
            tg.start_soon(store.schedule_fire_many, [fire("a", 101)])
            await until(lambda: len(store._writes._queue) == 2)
            release.set()
        conn = sqlite3.connect(tmp_path / "wf.db")
        try:
            order = [w for (w,) in conn.execute("SELECT workflow_id FROM history ORDER BY id")]
        finally:
            conn.close()
        assert order == ["a:101", "plain"]
