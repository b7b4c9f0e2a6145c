"""Recovery in process: a workflow that does not fit the code is held, and released by code that does."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon import On, S, Section, Step, Wait, Workflow
from daemon.clock import FakeClock
from daemon.errors import Conflict
from daemon.runtime import recovery
from daemon.runtime.runtime import Runtime
from daemon.runtime.settings import Settings
from daemon.store.sqlite import SQLiteStore
from handlers import FileWatch, Signal, Timer
from tests.helpers.wait import until, wait_runtime_status


@dataclass
class Ticket(Workflow):
    """Waits at `triage`, then closes."""

    closed: bool = False

    def definition(self) -> Section:
        return S(Wait("triage", On("go", Signal())), Step("close", self.close))

    def close(self) -> None:
        self.closed = True


@dataclass
class TicketRenamed(Ticket):
    """The same workflow with its Wait renamed."""

    name = "Ticket"

    def definition(self) -> Section:
        return S(Wait("sort", On("go", Signal())), Step("close", self.close))


OLD: dict[str, type[Workflow]] = {"Ticket": Ticket}
NEW: dict[str, type[Workflow]] = {"Ticket": TicketRenamed}


@dataclass
class Nap(Workflow):
    """Sleeps a minute on a timer (or until `poke`), then counts that it woke."""

    woken: int = 0

    def definition(self) -> Section:
        return S(
            Wait("nap", On("ring", Timer(after=60)), On("poke", Signal())),
            Step("woke", self.wake),
        )

    def wake(self) -> None:
        self.woken += 1


@dataclass
class NapRenamed(Nap):
    """The same workflow with its Wait renamed."""

    name = "Nap"

    def definition(self) -> Section:
        return S(Wait("doze", On("ring", Timer(after=60))), Step("woke", self.wake))


@dataclass
class Watch(Workflow):
    """Waits for a file to be created: a wait with a listener, so never recovered lean."""

    path: str = ""
    saw: bool = False

    def definition(self) -> Section:
        return S(Wait("w", On("made", FileWatch(self.path, on="created"))), Step("s", self.see))

    def see(self) -> None:
        self.saw = True


NAPS: dict[str, type[Workflow]] = {"Nap": Nap, "Watch": Watch}
NAPS_RENAMED: dict[str, type[Workflow]] = {"Nap": NapRenamed}


async def _naps(db: Path, clock: FakeClock, count: int) -> None:
    """Start `count` Naps (n0, n1, ...) and stop once they all sleep."""
    async with SQLiteStore.open(db) as store, Runtime.open(store, NAPS, clock=clock) as rt:
        for i in range(count):
            await rt.start("Nap", f"n{i}")
        for i in range(count):
            await wait_runtime_status(rt, f"n{i}", "Waiting")


class TestRecovery:
    async def test_unfit_is_held_and_released_by_refit(self, tmp_path: Path) -> None:
        """Held at start with the reason (send: Conflict); `refit` under code it fits frees it."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store, Runtime.open(store, OLD, clock=FakeClock()) as rt:
            await rt.start("Ticket", "t1")
            await wait_runtime_status(rt, "t1", "Waiting")
        async with SQLiteStore.open(db) as store, Runtime.open(store, NEW, clock=FakeClock()) as rt:
            assert rt.incompatible() == 1
            assert "statement 'triage' is gone" in (rt.unfit("t1") or "")
            shown = await rt.show("t1")
            assert shown["held"] is True and shown["status"] == "Waiting"
            with pytest.raises(Conflict, match="'triage' is gone"):
                await rt.send("t1", "go")
            still = await rt.refit()  # the same code: still held, and said so
            assert [s["workflow_id"] for s in still] == ["t1"]
            rt.configure(OLD, Settings())
            assert await rt.refit() == []
            assert rt.incompatible() == 0 and (await rt.show("t1"))["incompatible"] is None
            await rt.send("t1", "go")
            assert (await wait_runtime_status(rt, "t1", "Finished"))["data"]["closed"] is True

    async def test_inbox_row_of_a_missing_workflow_is_dropped(self, tmp_path: Path) -> None:
        """An acknowledged event for a workflow that does not exist is dropped at start."""
        db = tmp_path / "wf.db"
        async with SQLiteStore.open(db) as store, Runtime.open(store, OLD, clock=FakeClock()):
            await store.inbox_put("nobody", "go", None)
        async with SQLiteStore.open(db) as store, Runtime.open(store, OLD, clock=FakeClock()):
            assert await store.inbox_pending() == []
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT COUNT(*) FROM inbox").fetchone() == (0,)
        conn.close()


class TestLeanRecovery:
    """Past the first CHECKED_AT_START sleepers, timers are armed from the stored state alone."""

    async def test_lean_sleepers_fire_once_and_never_early(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Armed lean (none loaded at start), each timer fires once, at its deadline."""
        monkeypatch.setattr(recovery, "CHECKED_AT_START", 1)
        db, clock = tmp_path / "wf.db", FakeClock()
        await _naps(db, clock, 4)
        async with SQLiteStore.open(db) as store, Runtime.open(store, NAPS, clock=clock) as rt:
            assert len(rt.arms) == 4
            assert len(rt.cache.unchecked) == 3  # the first one was checked in full
            shown = await rt.show("n3")
            assert shown["status"] == "Waiting"
            clock.advance(59)
            await rt.wait_idle()
            assert (await rt.counts()) == {"Waiting": 4}
            clock.advance(2)
            for i in range(4):
                shown = await wait_runtime_status(rt, f"n{i}", "Finished")
                assert shown["data"]["woken"] == 1
            assert len(rt.arms) == 0

    async def test_an_event_for_a_lean_sleeper_loads_and_runs_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A send to a sleeper recovered lean applies; its timer is disarmed with the wait."""
        monkeypatch.setattr(recovery, "CHECKED_AT_START", 0)
        db, clock = tmp_path / "wf.db", FakeClock()
        await _naps(db, clock, 2)
        async with SQLiteStore.open(db) as store, Runtime.open(store, NAPS, clock=clock) as rt:
            assert "n1" in rt.cache.unchecked
            await rt.send("n1", "poke")
            assert (await wait_runtime_status(rt, "n1", "Finished"))["data"]["woken"] == 1
            assert rt.arms.armed("n1") == set()
            clock.advance(61)
            assert (await wait_runtime_status(rt, "n0", "Finished"))["data"]["woken"] == 1

    async def test_an_unfit_lean_sleeper_is_held_by_the_check_after_start(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The check after READY holds the unfit ones with the reason and disarms them."""
        monkeypatch.setattr(recovery, "CHECKED_AT_START", 1)
        db, clock = tmp_path / "wf.db", FakeClock()
        await _naps(db, clock, 3)
        async with (
            SQLiteStore.open(db) as store,
            Runtime.open(store, NAPS_RENAMED, clock=clock) as rt,
        ):
            await until(lambda: rt.incompatible() == 3 and not rt.cache.unchecked)
            assert "statement 'nap' is gone" in (rt.unfit("n2") or "")
            assert len(rt.arms) == 0
            clock.advance(61)
            await rt.wait_idle()
            assert (await rt.counts()) == {"Waiting": 3}

    async def test_an_unfit_sleeper_whose_timer_fires_first_is_held_at_load(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Loaded by its timer before the check came to it: held there, its timer kept."""
        monkeypatch.setattr(recovery, "CHECKED_AT_START", 0)
        db, clock = tmp_path / "wf.db", FakeClock()
        await _naps(db, clock, 1)
        clock.advance(61)  # due at once: it fires while the check after READY starts
        async with (
            SQLiteStore.open(db) as store,
            Runtime.open(store, NAPS_RENAMED, clock=clock) as rt,
        ):
            await until(lambda: rt.incompatible() == 1)
            await rt.wait_idle()
            assert (await rt.counts()) == {"Waiting": 1}
            rt.configure(NAPS, Settings())
            assert await rt.refit() == []
            shown = await wait_runtime_status(rt, "n0", "Finished")
            assert shown["data"]["woken"] == 1

    async def test_a_sleeper_with_a_listener_is_recovered_in_full(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A file watch needs its handler: that sleeper is checked and armed as before."""
        monkeypatch.setattr(recovery, "CHECKED_AT_START", 0)
        db, clock, made = tmp_path / "wf.db", FakeClock(), tmp_path / "made"
        await _naps(db, clock, 2)
        async with SQLiteStore.open(db) as store, Runtime.open(store, NAPS, clock=clock) as rt:
            await rt.start("Watch", "w1", {"path": str(made)})
            await wait_runtime_status(rt, "w1", "Waiting")
        async with SQLiteStore.open(db) as store, Runtime.open(store, NAPS, clock=clock) as rt:
            assert rt.cache.unchecked == {"n0", "n1"}
            assert rt.arms.kinds() == {"timer": 2, "listener": 1}
            made.write_text("")
            assert (await wait_runtime_status(rt, "w1", "Finished"))["data"]["saw"] is True
