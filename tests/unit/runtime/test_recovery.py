"""Recovery in process: a workflow that does not fit the code is held, and released by code that does."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon import On, S, Section, Step, Wait, Workflow
from daemon.clock import FakeClock
from daemon.errors import Conflict
from daemon.runtime.runtime import Runtime
from daemon.runtime.settings import Settings
from daemon.store.sqlite import SQLiteStore
from handlers import Signal
from tests.helpers.wait import wait_runtime_status


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
