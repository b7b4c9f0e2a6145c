"""The schedules' firing loop on a real runtime and SQLite store, with a fake clock."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon import Schedule
from daemon.clock import FakeClock, SystemClock, use_clock
from daemon.core.schedule import workflow_id
from daemon.errors import ScheduleNotFound, WorkflowNotFound
from daemon.runtime import schedules as schedules_module
from daemon.runtime.fires import SPACING_S, BatchStart, Entry
from daemon.runtime.runtime import Runtime
from daemon.runtime.schedules import Schedules
from daemon.store.base import FireRecord, History, WorkflowRow
from daemon.store.sqlite import SQLiteStore
from tests.helpers.wait import eventually
from tests.workflows.schedules import Chime, Lingers

REGISTRY: dict[str, Any] = {"Chime": Chime, "Lingers": Lingers}
#: The fake clock starts on a multiple of every interval used here.
T0 = 1_699_999_200.0  # 2023-11-14T22:00:00Z


@dataclass
class Bench:
    """A runtime, its store, the schedules loop and the fake clock they share."""

    rt: Runtime
    store: SQLiteStore
    clock: FakeClock
    schedules: Schedules
    held: list[bool] = field(default_factory=lambda: [False])

    async def fires(self, name: str) -> list[FireRecord]:
        """Return the schedule's kept fires and skips."""
        return await self.store.schedule_fires(name)

    async def kinds(self, name: str) -> list[str]:
        """Return the kinds of the schedule's records, oldest first."""
        return [f.kind for f in await self.fires(name)]

    async def to(self, at: float) -> None:
        """Move the fake clock to `at` in steps under the loop's grace, so it is no jump."""
        while self.clock.now() < at:
            self.clock.advance(min(1.0, at - self.clock.now()))
            await anyio.sleep(0.005)  # let the loop and the actors take their turn

    async def status(self, wid: str) -> str | None:
        """Return a workflow's status once the runtime is idle."""
        await self.rt.wait_idle()
        return await self.rt.status_of(wid)


@asynccontextmanager
async def bench(
    db: Path,
    *schedules: Schedule,
    start: Any = None,
    grace_s: float = 2.0,
    early: bool = False,
    t0: float = T0,
) -> AsyncIterator[Bench]:
    """Run a runtime and the schedules loop on a fake clock at `t0`.

    `early`: the runtime can hand over fires committed ahead of their instant (as workflowd's
    can), so a large instant may take that path.
    """
    clock = FakeClock(t0)
    async with (
        SQLiteStore.open(db) as store,
        Runtime.open(store, REGISTRY, clock=clock) as rt,
        anyio.create_task_group() as tg,
    ):
        b = Bench(rt, store, clock, None)  # type: ignore[arg-type]
        b.schedules = Schedules(
            store=store,
            clock=clock,
            start=start or rt.start,
            cancel=rt.cancel,
            status=rt.status_of,
            held=lambda: b.held[0],
            schedules={s.name: s for s in schedules},
            grace_s=grace_s,
            # A start of the test's own makes every fire take the one-at-a-time path.
            batch=None
            if start
            else BatchStart(rt.prepare_many, rt.launch_many, rt.release, rt.withdraw, rt.hold_turns)
            if early
            else BatchStart(rt.prepare_many, rt.launch_many),
        )
        rt.on_exit = b.schedules.workflow_exited
        await tg.start(b.schedules.run)
        yield b
        tg.cancel_scope.cancel()


async def fired_ids(b: Bench, name: str, want: int) -> list[str]:
    """Wait until the schedule started `want` workflows; return their ids."""

    async def enough() -> bool:
        return len(await started(b, name)) >= want

    await eventually(enough)
    return await started(b, name)


async def started(b: Bench, name: str) -> list[str]:
    """Return the ids of the workflows the schedule started, oldest first."""
    return [f.workflow_id for f in await b.fires(name) if f.workflow_id and f.kind in STARTS]


STARTS = ("fired", "caught_up", "manual")


class TestFiring:
    """On-time fires."""

    async def test_fires_at_each_nominal_time(self, tmp_path: Path) -> None:
        """Each interval starts one workflow with the nominal time in its id and the input."""
        s = Schedule("tick", "Chime", every=10, input={"label": "hi"})
        async with bench(tmp_path / "db", s) as b:
            assert await b.fires("tick") == []
            await b.to(T0 + 10)
            ids = await fired_ids(b, "tick", 1)
            assert ids == [workflow_id("tick", T0 + 10)]
            assert await b.status(ids[0]) == "Finished"
            assert (await b.rt.show(ids[0]))["data"]["label"] == "hi"
            await b.to(T0 + 30)
            ids = await fired_ids(b, "tick", 3)
            assert ids == [workflow_id("tick", T0 + k) for k in (10, 20, 30)]
            assert await b.kinds("tick") == ["fired"] * 3

    async def test_jitter_delays_the_start_not_the_id(self, tmp_path: Path) -> None:
        """A jittered fire starts `jitter(nominal)` after its nominal time, with the same id."""
        s = Schedule("jit", "Chime", every=60, jitter_s=30)
        delay = s.jitter(T0 + 60)
        assert delay > 0.5
        async with bench(tmp_path / "db", s) as b:
            await b.to(T0 + 60 + delay - 0.5)
            await b.rt.wait_idle()
            assert await b.fires("jit") == []  # the clock stands still: nothing can move
            await b.to(T0 + 61 + delay)
            assert await fired_ids(b, "jit", 1) == [workflow_id("jit", T0 + 60)]
            (fire,) = await b.fires("jit")
            assert fire.at >= T0 + 60 + delay

    async def test_clock_backward_never_repeats_a_fire(self, tmp_path: Path) -> None:
        """After the clock steps back, the next fire is still after the last one handled."""
        s = Schedule("back", "Chime", every=10, catchup="all", overlap="allow")
        async with bench(tmp_path / "db", s) as b:
            await b.to(T0 + 20)
            await fired_ids(b, "back", 2)
            b.clock.advance(-15.0)  # the wall clock steps back past both fires
            await b.to(T0 + 30)
            ids = await fired_ids(b, "back", 3)
            assert ids == [workflow_id("back", T0 + k) for k in (10, 20, 30)]

    async def test_a_failing_start_is_retried(self, tmp_path: Path) -> None:
        """A start that raises is logged and retried with backoff; the fire is not lost."""
        calls: list[str] = []

        async def flaky(workflow: str, wid: str | None = None, input: Any = None, *,
                        create: Any = None, quiet: bool = False) -> dict[str, Any]:  # fmt: skip
            calls.append(str(wid))
            if len(calls) == 1:
                raise OSError("disk full")
            return await real(workflow, wid, input, create=create, quiet=quiet)

        s = Schedule("flaky", "Chime", every=10)
        async with bench(tmp_path / "db", s, start=flaky) as b:
            real = b.rt.start
            await b.to(T0 + 10)

            async def tried() -> bool:
                return len(calls) >= 1

            await eventually(tried)
            await b.to(T0 + 12)  # past the 1 s backoff
            assert await fired_ids(b, "flaky", 1) == [workflow_id("flaky", T0 + 10)]
            assert calls == [workflow_id("flaky", T0 + 10)] * 2


class TestCatchUp:
    """After the clock jumps forward (a suspend), missed fires follow the policy."""

    async def test_once_after_a_jump(self, tmp_path: Path) -> None:
        """once: the newest missed time starts (late), the others are recorded as skipped."""
        s = Schedule("once", "Chime", every=10, catchup="once")
        async with bench(tmp_path / "db", s) as b:
            await b.to(T0 + 10)
            await fired_ids(b, "once", 1)
            await b.rt.wait_idle()  # ended: the catch-up is no overlap
            b.clock.advance(95.0)  # 9.5 intervals in one go: far past the grace
            ids = await fired_ids(b, "once", 2)
            assert ids[1] == workflow_id("once", T0 + 100)
            records = await b.fires("once")
            assert [(r.kind, r.count) for r in records] == [
                ("fired", 1), ("skipped", 8), ("caught_up", 1)
            ]  # fmt: skip
            assert records[1].reason == "missed"

    async def test_skip_after_a_jump(self, tmp_path: Path) -> None:
        """skip: nothing starts for the missed times; the next on-time one does."""
        s = Schedule("skip", "Chime", every=10, catchup="skip")
        async with bench(tmp_path / "db", s) as b:
            await b.to(T0 + 10)
            await fired_ids(b, "skip", 1)
            await b.rt.wait_idle()
            b.clock.advance(95.0)

            async def skipped() -> bool:
                return "skipped" in await b.kinds("skip")

            await eventually(skipped)
            await b.to(T0 + 110)
            ids = await fired_ids(b, "skip", 2)
            assert ids == [workflow_id("skip", T0 + 10), workflow_id("skip", T0 + 110)]
            assert [(r.kind, r.count) for r in await b.fires("skip")] == [
                ("fired", 1), ("skipped", 9), ("fired", 1)
            ]  # fmt: skip

    async def test_all_is_spread_out_in_order(self, tmp_path: Path) -> None:
        """all: one workflow per missed time, oldest first, at most one per SPACING_S."""
        s = Schedule("all", "Chime", every=10, catchup="all", overlap="allow")
        async with bench(tmp_path / "db", s) as b:
            await b.to(T0 + 10)
            await fired_ids(b, "all", 1)
            b.clock.advance(95.0)
            for _ in range(60):  # 3 fake seconds in small steps: room for 15 spaced starts
                b.clock.advance(0.05)
                await anyio.sleep(0.005)
            ids = await fired_ids(b, "all", 10)
            assert ids == [workflow_id("all", T0 + 10 * k) for k in range(1, 11)]
            caught = [r for r in await b.fires("all") if r.kind == "caught_up"]
            assert len(caught) == 9
            gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(caught)]
            assert min(gaps) >= SPACING_S - 1e-6

    async def test_all_only_inside_the_window(self, tmp_path: Path) -> None:
        """all: missed times older than catchup_window_s are given up, not started."""
        s = Schedule("win", "Chime", every=10, catchup="all", catchup_window_s=30, overlap="allow")
        async with bench(tmp_path / "db", s) as b:
            await b.to(T0 + 10)
            await fired_ids(b, "win", 1)
            b.clock.advance(95.0)
            for _ in range(40):
                b.clock.advance(0.05)
                await anyio.sleep(0.005)
            ids = await fired_ids(b, "win", 4)
            assert ids == [workflow_id("win", T0 + k) for k in (10, 80, 90, 100)]
            assert ("skipped", 6) in [(r.kind, r.count) for r in await b.fires("win")]


class TestOverlap:
    """A previous run still unfinished when the next fire comes."""

    async def overlapping(self, b: Bench, name: str, fires: int) -> None:
        """Move through `fires` nominal times while the first run lingers."""
        await b.to(T0 + 10)
        await fired_ids(b, name, 1)
        await b.rt.wait_idle()
        await b.to(T0 + 10 * fires)

    async def test_skip(self, tmp_path: Path) -> None:
        """skip: later fires are recorded as skipped while the first one runs."""
        async with bench(tmp_path / "db", Schedule("ov", "Lingers", every=10)) as b:
            await self.overlapping(b, "ov", 3)

            async def two_skips() -> bool:
                return (await b.kinds("ov")).count("skipped") == 2

            await eventually(two_skips)
            first = workflow_id("ov", T0 + 10)
            assert await started(b, "ov") == [first]
            reasons = {r.reason for r in await b.fires("ov") if r.kind == "skipped"}
            assert reasons == {f"overlap: {first} still running"}
            await b.rt.send(first, "finish", "test")
            await b.to(T0 + 40)
            assert (await fired_ids(b, "ov", 2))[1] == workflow_id("ov", T0 + 40)

    async def test_allow(self, tmp_path: Path) -> None:
        """allow: every fire starts, so runs pile up."""
        s = Schedule("ov", "Lingers", every=10, overlap="allow")
        async with bench(tmp_path / "db", s) as b:
            await self.overlapping(b, "ov", 3)
            for wid in await fired_ids(b, "ov", 3):
                assert await b.status(wid) == "Waiting"

    async def test_buffer_one(self, tmp_path: Path) -> None:
        """buffer_one: one fire waits, and starts as soon as the running one ends."""
        s = Schedule("ov", "Lingers", every=10, overlap="buffer_one")
        async with bench(tmp_path / "db", s) as b:
            await self.overlapping(b, "ov", 3)

            async def buffered_and_skipped() -> bool:
                return await b.kinds("ov") == ["fired", "buffered", "skipped"]

            await eventually(buffered_and_skipped)
            assert (await b.schedules.show("ov"))["buffered_at"] == T0 + 20
            await b.rt.send(workflow_id("ov", T0 + 10), "finish", "test")
            # Started without the clock moving: right after the first run ended.
            ids = await fired_ids(b, "ov", 2)
            assert ids[-1] == workflow_id("ov", T0 + 20)
            assert (await b.fires("ov"))[-1].reason == "buffered"
            assert (await b.schedules.show("ov"))["buffered_at"] is None

    async def test_cancel_other(self, tmp_path: Path) -> None:
        """cancel_other: the running one is cancelled and the new one starts."""
        s = Schedule("ov", "Lingers", every=10, overlap="cancel_other")
        async with bench(tmp_path / "db", s) as b:
            await self.overlapping(b, "ov", 3)
            ids = await fired_ids(b, "ov", 3)
            assert [await b.status(w) for w in ids] == ["Cancelled", "Cancelled", "Waiting"]


class TestControl:
    """Pause, resume, trigger, list and reload."""

    async def test_pause_then_resume_catches_up(self, tmp_path: Path) -> None:
        """A paused schedule fires nothing; resumed, its catch-up policy applies."""
        s = Schedule("p", "Chime", every=10, catchup="once")
        async with bench(tmp_path / "db", s) as b:
            assert await b.schedules.pause("p") == {"name": "p", "paused": True}
            await b.to(T0 + 35)
            await b.rt.wait_idle()
            assert await b.fires("p") == []
            assert (await b.schedules.list())[0]["paused"] is True
            assert (await b.schedules.list())[0]["next_fire_at"] is None
            assert await b.schedules.resume("p") == {"name": "p", "paused": False}
            assert await fired_ids(b, "p", 1) == [workflow_id("p", T0 + 30)]
            assert [(r.kind, r.count) for r in await b.fires("p")] == [
                ("skipped", 2), ("caught_up", 1)
            ]  # fmt: skip

    async def test_pause_survives_a_restart(self, tmp_path: Path) -> None:
        """The paused flag is stored."""
        s = Schedule("p", "Chime", every=10)
        async with bench(tmp_path / "db", s) as b:
            await b.schedules.pause("p")
        async with bench(tmp_path / "db", s) as b:
            assert (await b.schedules.show("p"))["paused"] is True

    async def test_trigger(self, tmp_path: Path) -> None:
        """trigger starts one workflow now, paused or not, without moving the schedule."""
        s = Schedule("t", "Chime", every=10)
        async with bench(tmp_path / "db", s) as b:
            await b.schedules.pause("t")
            result = await b.schedules.trigger("t")
            assert result["workflow_id"] == "t:manual:2023-11-14T22:00:00.000Z"
            assert result["created"] is True
            assert await b.status(result["workflow_id"]) == "Finished"
            shown = await b.schedules.show("t")
            assert shown["last_workflow_id"] == result["workflow_id"]
            assert shown["last_status"] == "Finished"
            assert shown["last_nominal_at"] == T0
            assert [r.kind for r in await b.fires("t")] == ["manual"]

    async def test_unknown_name(self, tmp_path: Path) -> None:
        """An unknown schedule is `not_found`, naming the known ones."""
        async with bench(tmp_path / "db", Schedule("a", "Chime", every=10)) as b:
            for call in (
                b.schedules.show,
                b.schedules.pause,
                b.schedules.resume,
                b.schedules.trigger,
            ):
                with pytest.raises(ScheduleNotFound, match="known: a"):
                    await call("nope")

    async def test_list_row(self, tmp_path: Path) -> None:
        """`schedules` rows carry the documented fields."""
        s = Schedule("l", "Chime", cron="*/5 * * * *", tz="Europe/Berlin")
        async with bench(tmp_path / "db", s) as b:
            (row,) = await b.schedules.list()
            assert row == {
                "name": "l", "workflow": "Chime", "spec": "*/5 * * * *", "tz": "Europe/Berlin",
                "next_fire_at": T0 + 300, "last_fire_at": None, "last_workflow_id": None,
                "last_status": None, "paused": False,
            }  # fmt: skip

    async def test_reload_adds_and_removes(self, tmp_path: Path) -> None:
        """configure() starts new schedules and stops removed ones; their rows stay."""
        async with bench(tmp_path / "db", Schedule("old", "Chime", every=10)) as b:
            b.schedules.configure({"new": Schedule("new", "Chime", every=10)})

            async def switched() -> bool:
                return [r["name"] for r in await b.schedules.list()] == ["new"]

            await eventually(switched)
            await b.to(T0 + 10)
            await fired_ids(b, "new", 1)
            assert await b.fires("old") == []

    async def test_hold_fires_nothing_until_released(self, tmp_path: Path) -> None:
        """Under `--hold` nothing fires; after release the catch-up policy applies."""
        s = Schedule("h", "Chime", every=10, catchup="once")
        async with bench(tmp_path / "db", s) as b:
            b.held[0] = True
            await b.to(T0 + 25)
            await b.rt.wait_idle()
            assert await b.fires("h") == []
            b.held[0] = False
            await b.to(T0 + 27)
            assert await fired_ids(b, "h", 1) == [workflow_id("h", T0 + 20)]


class TestAtomicFire:
    """The workflow and the schedule's row commit together."""

    async def test_a_failed_schedule_write_creates_no_workflow(self, tmp_path: Path) -> None:
        """If the schedule's part of the transaction fails, the workflow row is not kept."""
        async with SQLiteStore.open(tmp_path / "db") as store:
            await store.schedules_load(["real"], T0)
            row = WorkflowRow("x:1", "Chime", "Resuming", "{}", "{}")
            history: History = [("started", {"input": {}})]
            with pytest.raises(ScheduleNotFound):
                await store.schedule_fire("ghost", row, history, last_nominal=T0 + 1)
            assert await store.get("x:1") is None
            assert await store.schedule_fire("real", row, history, last_nominal=T0 + 1)
            (state,) = await store.schedules_load(["real"], T0 + 99)
            assert (state.last_nominal, state.last_workflow_id) == (T0 + 1, "x:1")
            # The same id again: the workflow stays as it was, the schedule never moves back.
            assert not await store.schedule_fire("real", row, history, last_nominal=T0)
            (state,) = await store.schedules_load(["real"], T0 + 99)
            assert state.last_nominal == T0 + 1


class TestBatch:
    """Fires due in one loop turn share one write; a fault in one stays its own."""

    async def test_due_together_fire_together(self, tmp_path: Path) -> None:
        """Schedules due at one instant are written in one batch: one commit stamp for all."""
        many = [Schedule(f"t{i}", "Chime", every=10) for i in range(20)]
        async with bench(tmp_path / "db", *many) as b:
            calls: list[int] = []
            real = b.store.schedule_fire_many

            async def counted(fires: Any) -> list[bool]:
                calls.append(len(fires))
                return await real(fires)

            b.store.schedule_fire_many = counted  # type: ignore[method-assign]
            await b.to(T0 + 10)
            for s in many:
                assert await fired_ids(b, s.name, 1) == [workflow_id(s.name, T0 + 10)]
            assert calls == [20]
            stamps = {(await b.fires(s.name))[0].at for s in many}
            assert len(stamps) == 1

    async def test_one_bad_start_does_not_hold_the_others(self, tmp_path: Path) -> None:
        """A start that cannot be made (input the type lacks) fails alone and is retried."""
        bad = Schedule("bad", "Chime", every=10, input={"no_such_field": 1})
        good = Schedule("good", "Chime", every=10)
        async with bench(tmp_path / "db", bad, good) as b:
            await b.to(T0 + 10)
            assert await fired_ids(b, "good", 1) == [workflow_id("good", T0 + 10)]
            await b.to(T0 + 30)
            assert await fired_ids(b, "good", 3) == [
                workflow_id("good", T0 + k) for k in (10, 20, 30)
            ]
            assert await b.fires("bad") == []  # not advanced: each retry tries 10 s again
            (state,) = await b.store.schedules_load(["bad"], T0)
            assert state.last_nominal == T0

    async def test_a_failed_batch_write_fires_each_alone(self, tmp_path: Path) -> None:
        """If the batch's write fails, each fire is tried on its own at once; none is lost."""
        many = [Schedule(f"w{i}", "Chime", every=10) for i in range(5)]
        async with bench(tmp_path / "db", *many) as b:
            failed: list[int] = []
            real = b.store.schedule_fire_many

            async def once_broken(fires: Any) -> list[bool]:
                if not failed:
                    failed.append(len(fires))
                    raise OSError("disk full")
                return await real(fires)

            b.store.schedule_fire_many = once_broken  # type: ignore[method-assign]
            await b.to(T0 + 10)
            for s in many:
                assert await fired_ids(b, s.name, 1) == [workflow_id(s.name, T0 + 10)]
            assert failed == [5]
            await b.to(T0 + 20)  # the next ones go in a batch again
            for s in many:
                assert await fired_ids(b, s.name, 2) == [
                    workflow_id(s.name, T0 + k) for k in (10, 20)
                ]


class TestPrepared:
    """On-time fires built ahead of their time: written at it, and decided again if the
    schedule changed meanwhile."""

    async def prepared(self, b: Bench, at: float) -> list[str]:
        """Move the clock to `at` (inside the second before a fire); return the prepared ids."""
        made: list[str] = []
        real = b.schedules._fires.prepare

        def spy(batch: Any) -> Any:
            out = real(batch)
            made.extend(f.workflow_id for f in out.ready)
            return out

        b.schedules._fires.prepare = spy  # type: ignore[method-assign]
        await b.to(at)

        async def built() -> bool:
            return bool(made)

        await eventually(built)
        return made

    async def test_nothing_is_written_before_its_time(self, tmp_path: Path) -> None:
        """A fire built ahead is neither a workflow nor a record until its nominal time."""
        s = Schedule("tick", "Chime", every=10, overlap="allow")
        async with bench(tmp_path / "db", s) as b:
            wid = workflow_id("tick", T0 + 10)
            assert await self.prepared(b, T0 + 9.5) == [wid]
            await b.rt.wait_idle()
            assert await b.fires("tick") == [] and await b.store.get(wid) is None
            await b.to(T0 + 10)
            assert await fired_ids(b, "tick", 1) == [wid]
            (fire,) = await b.fires("tick")
            row = await b.store.get(wid)
            assert row is not None and row.created_at >= T0 + 10 and fire.at >= T0 + 10

    async def test_a_pause_meanwhile_holds_it(self, tmp_path: Path) -> None:
        """Paused after its fire was built, the schedule starts nothing at its time."""
        s = Schedule("p", "Chime", every=10, catchup="skip")
        async with bench(tmp_path / "db", s) as b:
            await self.prepared(b, T0 + 9.5)
            await b.schedules.pause("p")
            await b.to(T0 + 12)
            await b.rt.wait_idle()
            assert await b.fires("p") == []
            assert await b.store.get(workflow_id("p", T0 + 10)) is None

    async def test_a_trigger_meanwhile_is_seen(self, tmp_path: Path) -> None:
        """Triggered after its fire was built, the schedule decides its fire again: the
        triggered run still going, its overlap policy skips the nominal one."""
        s = Schedule("t", "Lingers", every=10)
        async with bench(tmp_path / "db", s) as b:
            await self.prepared(b, T0 + 9.5)
            manual = await b.schedules.trigger("t")
            await b.to(T0 + 10.5)

            async def decided() -> bool:
                return len(await b.fires("t")) == 2

            await eventually(decided)
            assert await b.kinds("t") == ["manual", "skipped"]
            assert await b.store.get(workflow_id("t", T0 + 10)) is None
            assert await b.status(manual["workflow_id"]) == "Waiting"

    async def test_a_reload_meanwhile_fires_the_new_schedule(self, tmp_path: Path) -> None:
        """Reloaded with a new input after its fire was built, the fire starts with the new."""
        s = Schedule("r", "Chime", every=10, input={"label": "old"})
        async with bench(tmp_path / "db", s) as b:
            await self.prepared(b, T0 + 9.5)
            b.schedules.configure({"r": Schedule("r", "Chime", every=10, input={"label": "new"})})
            await b.to(T0 + 10)
            (wid,) = await fired_ids(b, "r", 1)
            assert await b.status(wid) == "Finished"
            assert (await b.rt.show(wid))["data"]["label"] == "new"
            await b.to(T0 + 11)
            assert await b.kinds("r") == ["fired"]  # once: the fire built before is dropped

    async def test_a_failure_to_build_ahead_fires_at_its_time(self, tmp_path: Path) -> None:
        """If building the fires ahead raises, each is decided at its time as any due fire."""
        s = Schedule("f", "Chime", every=10, overlap="allow")
        async with bench(tmp_path / "db", s) as b:
            real, calls = b.schedules._fires.prepare, list[int]()

            def broken(batch: Any) -> Any:
                calls.append(len(batch))
                if len(calls) == 1:
                    raise RuntimeError("built nothing")
                return real(batch)

            b.schedules._fires.prepare = broken  # type: ignore[method-assign]
            await b.to(T0 + 10)
            assert await fired_ids(b, "f", 1) == [workflow_id("f", T0 + 10)]
            assert calls[0] == 1 and await b.kinds("f") == ["fired"]


def test_next_due_is_the_planned_due_time() -> None:
    """`Entry.next_due`, the shortcut taken after each fire, gives what planning gives, on
    time or with times missed, for intervals and cron, with jitter and spacing."""
    schedules = [
        Schedule("a", "Chime", every=10),
        Schedule("b", "Chime", every=0.7, jitter_s=0.3),
        Schedule("c", "Chime", cron="*/5 * * * * *", tz="UTC", catchup="all"),
        Schedule("d", "Chime", cron="30 2 * * *", tz="Europe/Berlin", catchup="skip"),
    ]
    for s, last, ahead, fired in itertools.product(
        schedules, (T0, T0 + 3.5, T0 + 86400 * 200), (0.0, 1.0, 30.0, 86400.0 * 3), (None, 0.1)
    ):
        now = last + ahead
        for live_since in (last, now):
            e = Entry(s, last, live_since=live_since)
            if fired is not None:
                e.fired_at = now - fired
            assert e.next_due(now, SPACING_S) == e.due_at(e.plan(now), SPACING_S), (s, last, now)


# -- a large instant's fires committed ahead of it ---------------------------------------
# Durable by then, run at it, and taken back by a pause or a reload in between.

#: Just before the fire at T0 + 10: past the early commit (its lead is ~20 ms for one fire
#: at EARLY_OVER_S = 0), before the instant.
BEFORE = T0 + 9.99
AT = T0 + 10


@pytest.fixture
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


@pytest.mark.usefixtures("any_instant_is_large")
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

    async def test_an_event_before_the_instant_finds_no_workflow(self, tmp_path: Path) -> None:
        """An event for a workflow written ahead of its time, sent before that time, is
        answered as for a workflow not started (nothing applied, nothing run early); sent
        after it, it is applied."""
        s = Schedule("e", "Lingers", every=10, overlap="allow")
        async with bench(tmp_path / "db", s, early=True) as b:
            wid = workflow_id("e", AT)
            await committed_early(b, wid)
            for wait in (True, False):
                with pytest.raises(WorkflowNotFound):
                    await b.rt.send(wid, "finish", "early", wait=wait)
            assert not b.rt.scheduler.running(wid) and await b.status(wid) == "Resuming"
            assert await b.store.inbox_pending(wid) == []
            await b.to(AT)

            async def waiting() -> bool:
                return await b.status(wid) == "Waiting"

            await eventually(waiting)
            assert await b.rt.send(wid, "finish", "later") == "finishing"

            async def finished() -> bool:
                return await b.status(wid) == "Finished"

            await eventually(finished)
            row = await b.store.get(wid)
            assert row is not None and '"finished_by":"later"' in row.data

    async def test_a_lone_schedule_keeps_lead_zero(self, tmp_path: Path) -> None:
        """At its default threshold, small instants keep today's path (lead 0)."""
        async with bench(tmp_path / "db", Schedule("one", "Chime", every=10), early=True) as b:
            lead_for = b.schedules._lead_for
            with pytest.MonkeyPatch.context() as m:
                m.setattr(schedules_module, "EARLY_OVER_S", 0.010)
                assert lead_for(1) == 0.0 and lead_for(100) == 0.0
                assert 0.0 < lead_for(10_000) <= schedules_module.PREPARE_S


@pytest.mark.usefixtures("any_instant_is_large")
class TestEarlyRecovery:
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
                # No await between the look and the send's own: the instant cannot pass.
                assert wid in rt.recovery.deferred
                with pytest.raises(WorkflowNotFound):
                    await rt.send(wid, "ring")

                async def finished() -> bool:
                    return await rt.status_of(wid) == "Finished"

                await eventually(finished, limit_s=10)
                row = await store.get(wid)
                assert row is not None and row.updated_at >= t0 + 1
                history = await store.history(wid)
                assert [h.kind for h in history].count("started") == 1
