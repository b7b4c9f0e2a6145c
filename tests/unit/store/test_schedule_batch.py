"""`schedule_fire_many` on every backend: many fires, one transaction, all or nothing."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from daemon.errors import ScheduleNotFound
from daemon.store import schema
from daemon.store.base import FireRecord, ScheduleFire, WorkflowRow
from daemon.store.postgres import PostgresStore
from daemon.store.sqlite import TRIM_EVERY, SQLiteStore

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
