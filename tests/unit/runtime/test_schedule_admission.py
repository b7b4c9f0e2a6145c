"""Tests for the runtime's batch starts (a schedule's fires): their runs take turns.

At most `ADMIT_MAX` of them run at once; the others wait, durable, and nothing is lost: a
stop, a cancel or a look at one before its turn all find it as it was written.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from daemon import S, Section, Step, Workflow
from daemon.clock import FakeClock
from daemon.runtime import runtime as runtime_module
from daemon.runtime.runtime import Runtime
from daemon.runtime.settings import Settings
from daemon.store.base import History, WorkflowRow
from daemon.store.sqlite import SQLiteStore
from tests.helpers.wait import eventually, wait_runtime_status


@dataclass
class Turn(Workflow):
    """One async step that waits until the test opens the gate, then counts itself."""

    #: Opened by the test; a step started meanwhile waits on it.
    gate: ClassVar[list[anyio.Event]] = []
    ran: ClassVar[list[str]] = []
    label: str = ""
    steps: int = 0

    async def through(self) -> None:
        await Turn.gate[0].wait()
        self.steps += 1
        Turn.ran.append(self.label)

    def definition(self) -> Section:
        return S(Step("through", self.through))


@pytest.fixture(autouse=True)
def few_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let three batch-started workflows run at once; start each test with a closed gate."""
    monkeypatch.setattr(runtime_module, "ADMIT_MAX", 3)
    Turn.gate[:] = [anyio.Event()]
    Turn.ran.clear()


@asynccontextmanager
async def running(db: Path, **settings: Any) -> AsyncIterator[Runtime]:
    """Open a store and a runtime on it for the body of the block."""
    async with (
        SQLiteStore.open(db) as store,
        Runtime.open(store, {"Turn": Turn}, Settings(**settings), clock=FakeClock()) as rt,
    ):
        yield rt


async def start_batch(rt: Runtime, ids: Sequence[str], label: str | None = None) -> None:
    """Start `ids` as one batch, as a schedule's fires are (each labelled with its id, or all
    with `label`: one input shared, as one schedule's fires share theirs)."""
    assert isinstance(rt.store, SQLiteStore)
    store = rt.store

    async def create(rows: Sequence[tuple[WorkflowRow, History]]) -> list[bool]:
        return [await store.create(row, history) for row, history in rows]

    starts = [("Turn", wid, {"label": label or wid}) for wid in ids]
    out = await rt.start_many(starts, create=create)
    assert all(isinstance(o, dict) and o["created"] for o in out)


async def statuses(rt: Runtime, ids: Sequence[str]) -> list[str | None]:
    """Return the stored status of each id."""
    return [row.status if (row := await rt.store.get(wid)) else None for wid in ids]


IDS = [f"t{i}" for i in range(10)]


async def test_runs_take_turns_and_all_finish(tmp_path: Path) -> None:
    """Ten started at once: three run, seven wait (written, Resuming); all finish, each once."""
    with anyio.fail_after(20):
        async with running(tmp_path / "wf.db") as rt:
            await start_batch(rt, IDS)

            async def three_in_their_steps() -> bool:
                return len(rt.scheduler) == 3

            await eventually(three_in_their_steps)
            assert rt.busy() == 10  # the seven waiting count as work in progress
            assert await statuses(rt, IDS) == ["Resuming"] * 10
            assert len(rt.scheduler) == 3  # nobody else got in meanwhile
            Turn.gate[0].set()
            for wid in IDS:
                await wait_runtime_status(rt, wid, "Finished")
            await rt.wait_idle()
            assert sorted(Turn.ran) == sorted(IDS)
            assert rt.busy() == 0


async def test_the_waiting_ones_survive_a_stop(tmp_path: Path) -> None:
    """Stopped while seven wait their turn, the next start's recovery runs all ten."""
    with anyio.fail_after(20):
        async with running(tmp_path / "wf.db") as rt:
            await start_batch(rt, IDS)

            async def three_in_their_steps() -> bool:
                return len(rt.scheduler) == 3

            await eventually(three_in_their_steps)
        assert Turn.ran == []
        Turn.gate[0].set()
        async with running(tmp_path / "wf.db") as rt:
            for wid in IDS:
                await wait_runtime_status(rt, wid, "Finished")
        assert sorted(Turn.ran) == sorted(IDS)


async def test_a_cancel_or_a_look_before_its_turn(tmp_path: Path) -> None:
    """One waiting its turn is shown as written and cancelled at once; its turn then runs
    nothing, and the others finish."""
    with anyio.fail_after(20):
        async with running(tmp_path / "wf.db") as rt:
            await start_batch(rt, IDS)

            async def three_in_their_steps() -> bool:
                return len(rt.scheduler) == 3

            await eventually(three_in_their_steps)
            last = IDS[-1]
            shown = await rt.show(last)
            assert shown["status"] == "Resuming" and shown["data"]["label"] == last
            await rt.cancel(last)

            async def cancelled() -> bool:
                return await statuses(rt, [last]) == ["Cancelled"]

            await eventually(cancelled)  # while three others are still in their steps
            Turn.gate[0].set()
            for wid in IDS[:-1]:
                await wait_runtime_status(rt, wid, "Finished")
            await rt.wait_idle()
            assert (await rt.show(last))["status"] == "Cancelled"
            assert sorted(Turn.ran) == sorted(IDS[:-1])


async def test_held_ones_take_no_turn(tmp_path: Path) -> None:
    """Under `--hold` the batch is written and parked: no turn is taken, none runs."""
    with anyio.fail_after(20):
        async with running(tmp_path / "wf.db", hold=True) as rt:
            Turn.gate[0].set()
            await start_batch(rt, IDS)
            await rt.wait_idle()
            assert len(rt.scheduler) == 0 and rt.busy() == 0
            assert await statuses(rt, IDS) == ["Resuming"] * 10
            assert Turn.ran == []


async def test_a_shared_input_is_each_ones_own(tmp_path: Path) -> None:
    """Starts of one input run, each in its turn, from that input: not from the data of one
    that ran before (they share what was built from it)."""
    with anyio.fail_after(20):
        async with running(tmp_path / "wf.db") as rt:
            Turn.gate[0].set()
            await start_batch(rt, IDS, label="same")
            for wid in IDS:
                shown = await wait_runtime_status(rt, wid, "Finished")
                assert (shown["data"]["label"], shown["data"]["steps"]) == ("same", 1), wid
