"""A large instant's fires committed ahead of it: durable by then, run at it, and taken back
by a pause or a reload in between (a real runtime and SQLite store, a fake clock)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import anyio
import pytest

from daemon import Schedule
from daemon.clock import SystemClock, use_clock
from daemon.core.schedule import workflow_id
from daemon.runtime import schedules as schedules_module
from daemon.runtime.runtime import Runtime
from daemon.store.sqlite import SQLiteStore
from tests.helpers.wait import eventually
from tests.unit.runtime.test_schedules import REGISTRY, T0, Bench, bench, fired_ids

#: Just before the fire at T0 + 10: past the early commit (its lead is ~20 ms for one fire
#: at EARLY_OVER_S = 0), before the instant.
BEFORE = T0 + 9.99
AT = T0 + 10


@pytest.fixture(autouse=True)
def any_instant_is_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Have every instant take the early path, however few fires it has."""
    monkeypatch.setattr(schedules_module, "EARLY_OVER_S", 0.0)


async def committed_early(b: Bench, wid: str) -> None:
    """Move the clock to BEFORE and wait until `wid` is written (ahead of its instant)."""
    await b.to(BEFORE)

    async def written() -> bool:
        return await b.store.get(wid) is not None

    await eventually(written)


async def state_of(b: Bench, name: str) -> tuple[float, str | None, float | None]:
    """Return the schedule's stored last_nominal, last workflow id and last fire time."""
    (row,) = await b.store.schedules_load([name], T0)
    return row.last_nominal, row.last_workflow_id, row.last_fire_at


class TestEarly:
    async def test_written_ahead_run_at_the_instant_shown_truthfully(self, tmp_path: Path) -> None:
        """Committed before its instant, the workflow does not run and is not shown as fired
        before it; at the instant it runs, once."""
        s = Schedule("tick", "Chime", every=10, overlap="allow")
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("tick", AT)
            await committed_early(b, wid)
            row = await b.store.get(wid)
            assert row is not None and row.status == "Resuming"
            assert not b.rt.scheduler.running(wid)
            assert (await state_of(b, "tick"))[:2] == (AT, wid)  # durable already
            shown = await b.schedules.show("tick")
            assert shown["fires"] == [] and shown["last_workflow_id"] is None
            assert shown["next_fire_at"] == AT and shown["last_nominal_at"] == T0
            await anyio.sleep(0.05)  # the loop's turns pass; the instant has not come
            assert await b.status(wid) == "Resuming" and not b.rt.scheduler.running(wid)
            await b.to(AT)
            assert await fired_ids(b, "tick", 1) == [wid]
            assert await b.status(wid) == "Finished"
            shown = await b.schedules.show("tick")
            assert [f["workflow_id"] for f in shown["fires"]] == [wid]
            assert shown["last_workflow_id"] == wid and shown["next_fire_at"] == T0 + 20
            await b.to(T0 + 15)
            assert await b.kinds("tick") == ["fired"]

    async def test_a_pause_between_takes_it_back(self, tmp_path: Path) -> None:
        """Paused between the early commit and the instant: no workflow, no record, the
        schedule's row back as it was, paused, all in one transaction; nothing fires."""
        s = Schedule("p", "Chime", every=10, catchup="skip")
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("p", AT)
            await committed_early(b, wid)
            assert await b.schedules.pause("p") == {"name": "p", "paused": True}
            assert await b.store.get(wid) is None
            assert await b.fires("p") == []
            assert await state_of(b, "p") == (T0, None, None)
            (row,) = await b.store.schedules_load(["p"], T0)
            assert row.paused
            await b.to(T0 + 12)
            await b.rt.wait_idle()
            assert await b.store.get(wid) is None and await b.fires("p") == []
            await b.schedules.resume("p")  # catchup="skip": T0 + 10 was missed
            await b.to(T0 + 20)
            assert await fired_ids(b, "p", 1) == [workflow_id("p", T0 + 20)]
            assert await b.kinds("p") == ["skipped", "fired"]

    async def test_a_reload_dropping_it_takes_it_back(self, tmp_path: Path) -> None:
        """Removed by a reload between the early commit and the instant, it starts nothing."""
        s = Schedule("gone", "Chime", every=10)
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("gone", AT)
            await committed_early(b, wid)
            b.schedules.configure({})

            async def taken_back() -> bool:
                return await b.store.get(wid) is None

            await eventually(taken_back)
            assert await b.fires("gone") == [] and await state_of(b, "gone") == (T0, None, None)
            await b.to(T0 + 12)
            await b.rt.wait_idle()
            assert await b.store.get(wid) is None and await b.fires("gone") == []

    async def test_a_reload_changing_it_fires_the_new_one(self, tmp_path: Path) -> None:
        """Changed by a reload in between, its early fire is taken back and it fires at its
        instant with the new input, once."""
        s = Schedule("r", "Chime", every=10, input={"label": "old"})
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("r", AT)
            await committed_early(b, wid)
            b.schedules.configure({"r": Schedule("r", "Chime", every=10, input={"label": "new"})})
            await b.to(AT)
            assert await fired_ids(b, "r", 1) == [wid]
            assert await b.status(wid) == "Finished"
            assert (await b.rt.show(wid))["data"]["label"] == "new"
            await b.to(T0 + 15)
            assert await b.kinds("r") == ["fired"]

    async def test_a_reload_of_the_same_schedule_keeps_it(self, tmp_path: Path) -> None:
        """A reload that leaves the schedule as it was (new objects, same settings) keeps the
        early fire: it runs at its instant, once, from the one write."""

        def make() -> Schedule:
            return Schedule("k", "Chime", every=10, input={"label": "same"})

        async with bench(tmp_path / "db", make(), early=True) as b:
            wid = workflow_id("k", AT)
            await committed_early(b, wid)
            written = await b.store.get(wid)
            b.schedules.configure({"k": make()})
            await anyio.sleep(0.05)  # the reload is applied
            assert await b.store.get(wid) == written
            await b.to(AT)
            assert await fired_ids(b, "k", 1) == [wid]
            assert await b.status(wid) == "Finished"
            await b.to(T0 + 15)
            assert await b.kinds("k") == ["fired"]

    async def test_a_trigger_between_waits_for_the_instant(self, tmp_path: Path) -> None:
        """Triggered in between, the manual run starts after the committed fire took effect."""
        s = Schedule("t", "Chime", every=10, overlap="allow")
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("t", AT)
            await committed_early(b, wid)
            answers: list[dict[str, object]] = []

            async def trigger() -> None:
                answers.append(await b.schedules.trigger("t"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(trigger)
                await anyio.sleep(0.05)
                assert answers == []  # waits for the instant
                await b.to(AT)
            assert await b.kinds("t") == ["fired", "manual"]
            assert (await b.schedules.show("t"))["last_workflow_id"] == answers[0]["workflow_id"]

    async def test_the_clock_stepping_back_between_repeats_nothing(self, tmp_path: Path) -> None:
        """The wall clock stepping back after the early commit: the fire happens once."""
        s = Schedule("b", "Chime", every=10, overlap="allow")
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("b", AT)
            await committed_early(b, wid)
            b.clock.advance(-5.0)
            await anyio.sleep(0.05)
            await b.to(T0 + 15)
            assert await fired_ids(b, "b", 1) == [wid]
            assert await b.status(wid) == "Finished"
            await b.to(T0 + 19)
            assert await b.kinds("b") == ["fired"]

    async def test_a_cancelled_one_stands_when_paused(self, tmp_path: Path) -> None:
        """A workflow committed early and cancelled before its instant is not taken back by a
        pause: its fire stands (its record, the schedule's progress), it stays Cancelled."""
        s = Schedule("c", "Chime", every=10, overlap="allow")
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("c", AT)
            await committed_early(b, wid)
            await b.rt.cancel(wid)
            assert await b.status(wid) == "Cancelled"
            await b.schedules.pause("c")
            assert await b.status(wid) == "Cancelled"
            assert (await state_of(b, "c"))[:2] == (AT, wid)
            await b.to(AT)

            async def took_effect() -> bool:
                return bool((await b.schedules.show("c"))["last_workflow_id"] == wid)

            await eventually(took_effect)
            assert await b.kinds("c") == ["fired"] and await b.status(wid) == "Cancelled"

    async def test_one_cancelled_between_stays_cancelled(self, tmp_path: Path) -> None:
        """Cancelled before its instant and then out of the cache (a busy daemon's cache
        turns over), the workflow is not run at its instant from the start it was built as."""
        s = Schedule("x", "Chime", every=10, overlap="allow")
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("x", AT)
            await committed_early(b, wid)
            await b.rt.cancel(wid)
            assert await b.status(wid) == "Cancelled"
            b.rt.cache.forget(wid)
            await b.to(AT)

            async def took_effect() -> bool:
                return bool((await b.schedules.show("x"))["last_workflow_id"] == wid)

            await eventually(took_effect)
            assert await b.status(wid) == "Cancelled"
            row = await b.store.get(wid)
            assert row is not None and '"rang":false' in row.data

    async def test_a_lone_schedule_keeps_lead_zero(self, tmp_path: Path) -> None:
        """At its default threshold, small instants keep today's path (lead 0)."""
        async with bench(tmp_path / "db", Schedule("one", "Chime", every=10), early=True) as b:
            lead_for = b.schedules._lead_for
            with pytest.MonkeyPatch.context() as m:
                m.setattr(schedules_module, "EARLY_OVER_S", 0.010)
                assert lead_for(1) == 0.0 and lead_for(100) == 0.0
                assert 0.0 < lead_for(10_000) <= schedules_module.PREPARE_S


class TestRecovery:
    async def test_a_stop_between_leaves_it_to_run_at_its_instant(self, tmp_path: Path) -> None:
        """Stopped between the early commit and the instant, the fire stays durable; the next
        start's recovery runs its workflow at the instant, not before, once."""
        t0 = float(math.ceil(time.time())) + 1  # a fake clock on the real time's scale
        db = tmp_path / "db"
        s = Schedule("k", "Chime", every=1, overlap="allow")
        wid = workflow_id("k", t0 + 1)
        async with bench(db, s, early=True, t0=t0) as b:
            await b.to(t0 + 0.99)

            async def written() -> bool:
                return await b.store.get(wid) is not None

            await eventually(written)
        use_clock(SystemClock())  # the stores' stamps real again (the bench set its fake)
        # The real clock is now before t0 + 1, the instant (the store says when, too).
        async with SQLiteStore.open(db) as store:
            assert await store.deferred_starts(time.time()) == {wid: t0 + 1}
            async with Runtime.open(store, REGISTRY) as rt:  # it recovers as it opens
                assert not rt.scheduler.running(wid) and time.time() < t0 + 1
                assert await rt.status_of(wid) == "Resuming"

                async def finished() -> bool:
                    return await rt.status_of(wid) == "Finished"

                await eventually(finished, limit_s=10)
                row = await store.get(wid)
                assert row is not None and row.updated_at >= t0 + 1
                history = await store.history(wid)
                assert [h.kind for h in history].count("started") == 1
