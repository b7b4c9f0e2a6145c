"""Tests for daemon.runtime.children: child workflows in an in-process runtime on SQLite."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon import On, S, Section, Step, Wait, Workflow
from daemon.clock import FakeClock
from daemon.runtime.runtime import Runtime
from daemon.runtime.settings import Settings
from daemon.store.sqlite import SQLiteStore
from handlers import Child, Signal, Timer
from tests.helpers.wait import eventually, wait_runtime_status


@dataclass
class Leaf(Workflow):
    """Waits for `go`, then doubles `n`; `result()` reports it."""

    n: int = 0

    def double(self) -> None:
        self.n *= 2

    def result(self) -> int:
        """Return the doubled number."""
        return self.n

    def definition(self) -> Section:
        return S(Wait("w", On("go", Signal())), Step("double", self.double))


@dataclass
class Trunk(Workflow):
    """Waits for a Leaf child, or a timer of `after` seconds."""

    after: float = 3600.0
    outcome: dict[str, Any] = field(default_factory=dict)

    def took(self, outcome: dict[str, Any]) -> None:
        self.outcome = outcome

    def definition(self) -> Section:
        return S(
            Wait(
                "w",
                On("kid", Child("Leaf", input={"n": 21}, fn=self.took)),
                On("late", Timer(after=self.after)),
            )
        )


REGISTRY: dict[str, type[Workflow]] = {"Leaf": Leaf, "Trunk": Trunk}


@asynccontextmanager
async def running(db: Path, clock: FakeClock) -> AsyncIterator[Runtime]:
    """Open a store and a runtime on it for the body of the block."""
    async with (
        SQLiteStore.open(db) as store,
        Runtime.open(store, REGISTRY, Settings(), clock=clock) as rt,
    ):
        yield rt


class TestChildLinks:
    async def test_child_result_reaches_parent(self, tmp_path: Path) -> None:
        """The parent's case fires with the child's `result()` once the child finishes."""
        async with running(tmp_path / "db", FakeClock()) as rt:
            await rt.start("Trunk", "t")
            await wait_runtime_status(rt, "t/kid/1", "Waiting")
            assert [r["workflow_id"] for r in await rt.list(parent="t")] == ["t/kid/1"]
            await rt.send("t/kid/1", "go")
            shown = await wait_runtime_status(rt, "t", "Finished")
            assert shown["data"]["outcome"] == {
                "workflow_id": "t/kid/1",
                "status": "Finished",
                "result": 42,
                "error": None,
            }

    async def test_timer_winning_cancels_the_child(self, tmp_path: Path) -> None:
        """When the timer case wins, the child is cancelled as its case is torn down."""
        clock = FakeClock()
        async with running(tmp_path / "db", clock) as rt:
            await rt.start("Trunk", "t", {"after": 5})
            await wait_runtime_status(rt, "t/kid/1", "Waiting")
            clock.advance(5)
            await wait_runtime_status(rt, "t", "Finished")
            assert (await rt.show("t/kid/1"))["status"] == "Cancelled"

    async def test_restart_finds_the_same_child(self, tmp_path: Path) -> None:
        """After a restart, the parent's re-armed case waits for the child it started."""
        clock = FakeClock()
        async with running(tmp_path / "db", clock) as rt:
            await rt.start("Trunk", "t")
            await wait_runtime_status(rt, "t/kid/1", "Waiting")
        async with running(tmp_path / "db", clock) as rt:
            await rt.send("t/kid/1", "go")
            shown = await wait_runtime_status(rt, "t", "Finished")
            assert shown["data"]["outcome"]["result"] == 42
            assert len(await rt.list(parent="t")) == 1

    async def test_an_existing_workflow_is_not_adopted(self, tmp_path: Path) -> None:
        """A Child id naming a workflow the parent did not start is a setup error, shown."""
        async with running(tmp_path / "db", FakeClock()) as rt:
            await rt.start("Leaf", "t/kid/1")
            await rt.start("Trunk", "t")

            async def refused() -> bool:
                return "is not a child of 't'" in ((await rt.show("t"))["error"] or "")

            # Its actor sleeps until the retry of the setup (on the fake clock): no wait_idle.
            await eventually(refused)
            assert (await rt.show("t/kid/1"))["parent"] is None
