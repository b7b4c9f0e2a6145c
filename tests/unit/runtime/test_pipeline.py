"""Tests for the checkpoint pipeline: order, merging, failure, and the actor that uses it."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from daemon import For, S, Section, Step, Workflow
from daemon.clock import FakeClock
from daemon.runtime.pipeline import _HOLDS, Pipeline, Save
from daemon.runtime.runtime import Runtime
from daemon.runtime.settings import Settings
from daemon.runtime.work import Item
from daemon.store.sqlite import SQLiteStore
from tests.helpers.wait import eventually, until, wait_runtime_status


def save(n: int, *items: Item) -> Save:
    """Return a checkpoint whose data is `n`, with one history entry naming it."""
    return Save(
        status="Resuming",
        data=str(n),
        state="{}",
        error=None,
        attempt=0,
        next_run_at=None,
        history=[("step_done", {"n": n})],
        items=list(items),
    )


class Writes:
    """A store's writes: each waits for its gate (if any), may fail, and is recorded."""

    def __init__(self) -> None:
        self.written: list[tuple[str, int, list[int]]] = []
        self.gates: dict[str, anyio.Event] = {}
        self.fail: set[str] = set()
        self.started: list[str] = []

    async def __call__(self, s: Save) -> None:
        self.started.append(s.data)
        gate = self.gates.get(s.data)
        if gate is not None:
            await gate.wait()
        if s.data in self.fail:
            raise sqlite3.OperationalError("database is locked")
        self.written.append((s.data, s.count, [detail["n"] for _, detail in s.history]))


class TestPipeline:
    """One write in flight; later checkpoints merge into one queued write."""

    async def test_in_order_and_merged(self) -> None:
        """Checkpoints taken while one commits become one write, with all their history."""
        writes = Writes()
        writes.gates["1"] = gate = anyio.Event()
        durable: list[str] = []
        p = Pipeline(writes, on_durable=lambda s: durable.append(s.data))
        await p.put(save(1))
        await until(lambda: writes.started == ["1"])
        for n in (2, 3, 4):
            await p.put(save(n))
        assert not p.idle and writes.written == []
        gate.set()
        await p.flush()
        assert writes.written == [("1", 1, [1]), ("4", 3, [2, 3, 4])]
        assert durable == ["1", "4"] and p.idle

    async def test_put_waits_when_far_ahead(self) -> None:
        """A queued write that stands for `ahead` checkpoints makes the next put wait."""
        writes = Writes()
        writes.gates["1"] = gate = anyio.Event()
        p = Pipeline(writes, ahead=3)
        await p.put(save(1))
        await until(lambda: writes.started == ["1"])
        await p.put(save(2))
        await p.put(save(3))
        blocked = anyio.Event()

        async def fourth() -> None:
            await p.put(save(4))
            blocked.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(fourth)
            await until(lambda: p._queued is not None and p._queued.count == 3)
            assert not blocked.is_set()  # 2, 3 and 4 queued: 4 waits for the commits
            gate.set()
        assert [w for w, _, _ in writes.written] == ["1", "4"]

    async def test_a_held_checkpoint_merges_with_the_next_one(self) -> None:
        """A checkpoint queued with `hold` is not written before the next one joins it."""
        writes = Writes()
        p = Pipeline(writes, hold_s=3600)  # never issued by its timer within this test
        assert not p.queue(save(1), hold=True)
        await anyio.lowlevel.checkpoint()  # a loop turn: a write not held starts in it
        assert writes.started == [] and not p.idle
        assert not p.queue(save(2))
        await p.flush()
        assert writes.written == [("2", 2, [1, 2])] and p.idle

    async def test_a_held_checkpoint_is_written_once_its_hold_is_over(self) -> None:
        """With nothing after it, a held checkpoint is written anyway: a slow step overlaps it."""
        writes = Writes()
        p = Pipeline(writes, hold_s=0.001)
        p.queue(save(1), hold=True)
        await until(lambda: writes.written == [("1", 1, [1])])
        assert p.idle

    async def test_a_step_result_right_after_the_hold_still_merges(self) -> None:
        """A save whose step's result comes in just after its hold ended (a busy loop) merges.

        The result arrives as I/O in the loop turn after the one that runs the hold's timer:
        its actor's save must still find the held write queued, not in flight.
        """
        writes = Writes()
        p = Pipeline(writes, hold_s=0.001)
        loop = asyncio.get_running_loop()
        result, sender = socket.socketpair()
        result.setblocking(False)

        def delivered() -> None:  # what a worker's delivery does: its actor goes on next turn
            result.recv(1)
            loop.remove_reader(result)
            loop.call_soon(p.queue, save(2))

        try:
            loop.add_reader(result, delivered)
            p.queue(save(1), hold=True)
            time.sleep(0.01)  # noqa: ASYNC251 - the busy loop itself: the hold ends meanwhile
            # Sent in the turn that runs the hold's timer: seen by the loop's next look.
            loop.call_soon(sender.send, b"x")
            await until(lambda: p.idle and len(writes.written) >= 1)  # no flush: it issues
        finally:
            loop.remove_reader(result)
            result.close()
            sender.close()
        assert writes.written == [("2", 2, [1, 2])]

    async def test_flush_and_settle_issue_a_held_write_at_once(self) -> None:
        """Whoever waits for durability (or for the write in flight) does not wait out a hold."""
        writes = Writes()
        p = Pipeline(writes, hold_s=3600)
        p.queue(save(1), hold=True)
        await p.flush()
        p.queue(save(2), hold=True)
        await p.settle()
        assert [w for w, _, _ in writes.written] == ["1", "2"]

    async def test_a_hold_ended_early_leaves_no_timer_behind(self) -> None:
        """Once no hold is left, the holds' timer is cancelled: the loop is not woken for it."""
        writes = Writes()
        p = Pipeline(writes, hold_s=3600)
        p.queue(save(1), hold=True)
        holds = _HOLDS[asyncio.get_running_loop()]
        assert holds._timer is not None
        await p.commit(save(2))  # takes the held checkpoint into its own write
        assert holds._timer is None and not holds._held
        p.queue(save(3), hold=True)  # held again: a timer again
        assert holds._timer is not None
        await p.flush()
        assert holds._timer is None
        assert [w for w, _, _ in writes.written] == ["2", "3"]

    async def test_a_hold_still_held_is_issued_when_another_ended_early(self) -> None:
        """Withdrawing one pipeline's hold leaves the others' holds to end on time."""
        first, second = Writes(), Writes()
        a, b = Pipeline(first, hold_s=0.001), Pipeline(second, hold_s=0.001)
        a.queue(save(1), hold=True)
        b.queue(save(2), hold=True)
        await a.commit(save(3))  # a's hold ends early; b's is still due
        await until(lambda: second.written == [("2", 1, [2])])
        assert first.written == [("3", 2, [1, 3])] and a.idle and b.idle
        assert _HOLDS[asyncio.get_running_loop()]._timer is None

    async def test_a_hold_held_again_ends_as_the_first_one_would(self) -> None:
        """A pipeline held, issued and held again while another holds is written both times."""
        writes, other = Writes(), Writes()
        a, b = Pipeline(writes, hold_s=0.005), Pipeline(other, hold_s=0.005)
        b.queue(save(9), hold=True)  # a hold live while a's is withdrawn and taken again
        a.queue(save(1), hold=True)
        await a.flush()
        a.queue(save(2), hold=True)
        await until(lambda: [w for w, _, _ in writes.written] == ["1", "2"])
        await until(lambda: other.written == [("9", 1, [9])])
        assert a.idle and b.idle and _HOLDS[asyncio.get_running_loop()]._timer is None

    async def test_failure_drops_what_follows(self) -> None:
        """A failed write loses those queued after it; put and flush raise; events come back."""
        writes = Writes()
        writes.gates["2"] = gate = anyio.Event()
        writes.fail.add("2")
        a, b, c = (Item(kind="callback", inbox_id=i) for i in (10, 11, 12))
        p = Pipeline(writes)
        await p.put(save(1, a))
        await p.flush()
        await p.put(save(2, b))
        await until(lambda: writes.started == ["1", "2"])
        await p.put(save(3, c))  # queued behind the failing write
        gate.set()
        with pytest.raises(sqlite3.OperationalError):
            await p.flush()
        with pytest.raises(sqlite3.OperationalError):
            await p.put(save(4))
        assert [w for w, _, _ in writes.written] == ["1"]
        await p.settle()
        assert p.undurable() == [b, c]
        await p.put(save(5))  # a fresh start after the actor went back to the durable state
        await p.flush()
        assert [w for w, _, _ in writes.written] == ["1", "5"]


class TestCommit:
    """`commit` puts and flushes; with nothing in flight it awaits the write itself."""

    async def test_nothing_in_flight_writes_in_the_callers_task(self) -> None:
        """The write runs in the caller's task (no task of its own) and is durable on return."""
        tasks: list[asyncio.Task[Any] | None] = []
        durable: list[str] = []

        async def write(s: Save) -> None:
            tasks.append(asyncio.current_task())
            await anyio.lowlevel.checkpoint()

        p = Pipeline(write, on_durable=lambda s: durable.append(s.data))
        await p.commit(save(1))
        assert tasks == [asyncio.current_task()] and durable == ["1"] and p.idle

    async def test_a_held_checkpoint_goes_into_the_same_write(self) -> None:
        """A held checkpoint is merged into the commit's write, not written later on its own."""
        writes = Writes()
        p = Pipeline(writes, hold_s=0.001)
        p.queue(save(1), hold=True)
        await p.commit(save(2))
        await anyio.sleep(0.01)  # past the hold: its timer finds nothing left to issue
        assert writes.written == [("2", 2, [1, 2])] and p.idle

    async def test_a_deferred_checkpoint_is_written_by_the_commit_in_its_task(self) -> None:
        """A deferred checkpoint starts no write; the commit after it writes both, in its task."""
        tasks: list[asyncio.Task[Any] | None] = []
        written: list[tuple[str, int]] = []

        async def write(s: Save) -> None:
            tasks.append(asyncio.current_task())
            written.append((s.data, s.count))

        p = Pipeline(write)
        assert not p.queue(save(1), defer=True)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        assert written == [] and not p.idle
        await p.commit(save(2))
        assert written == [("2", 2)] and tasks == [asyncio.current_task()] and p.clean

    async def test_a_deferred_checkpoint_is_not_held_by_the_next_one(self) -> None:
        """A step starting after a deferred checkpoint issues it: its sender is not held back."""
        writes = Writes()
        p = Pipeline(writes, hold_s=3600)  # a hold would outlast this test
        p.queue(save(1), defer=True)
        p.queue(save(2), hold=True)
        await until(lambda: writes.written == [("2", 2, [1, 2])])
        holds = _HOLDS.get(asyncio.get_running_loop())
        assert p.idle and (holds is None or holds._timer is None)

    @pytest.mark.parametrize("how", ["flush", "settle"])
    async def test_flush_and_settle_write_a_deferred_checkpoint(self, how: str) -> None:
        """Whoever waits for what is queued (an error's back-off, shutdown) gets it written."""
        writes = Writes()
        p = Pipeline(writes)
        p.queue(save(1), defer=True)
        await getattr(p, how)()
        assert writes.written == [("1", 1, [1])] and p.idle

    async def test_behind_a_write_in_flight_it_waits_for_both_in_order(self) -> None:
        """A write in flight is committed first; then the commit's own."""
        writes = Writes()
        writes.gates["1"] = gate = anyio.Event()
        p = Pipeline(writes)
        await p.put(save(1))
        await until(lambda: writes.started == ["1"])
        async with anyio.create_task_group() as tg:
            tg.start_soon(p.commit, save(2))
            await anyio.lowlevel.checkpoint()
            assert writes.started == ["1"]
            gate.set()
        assert [w for w, _, _ in writes.written] == ["1", "2"] and p.idle

    async def test_committing_while_the_write_is_awaited(self) -> None:
        """`committing` is True exactly while the caller awaits its own write."""
        writes = Writes()
        writes.gates["1"] = gate = anyio.Event()
        p = Pipeline(writes)
        assert not p.committing
        async with anyio.create_task_group() as tg:
            tg.start_soon(p.commit, save(1))
            await until(lambda: writes.started == ["1"])
            assert p.committing and not p.idle
            gate.set()
        assert not p.committing and p.idle

    async def test_a_failed_commit_raises_and_hands_back_its_events(self) -> None:
        """The error reaches the caller; put raises it until `undurable` forgets it."""
        writes = Writes()
        writes.fail.add("1")
        a = Item(kind="callback", inbox_id=10)
        durable: list[str] = []
        p = Pipeline(writes, on_durable=lambda s: durable.append(s.data))
        with pytest.raises(sqlite3.OperationalError):
            await p.commit(save(1, a))
        with pytest.raises(sqlite3.OperationalError):
            await p.put(save(2))
        assert durable == [] and not p.committing
        assert p.undurable() == [a]
        await p.commit(save(3))
        assert [w for w, _, _ in writes.written] == ["3"]


#: Step indexes in the order they ran (one workflow per test).
RAN: list[int] = []


@dataclass
class Steady(Workflow):
    """Counts `i` up to `upto`, noting each step's index in RAN."""

    upto: int = 10
    i: int = 0
    seen: list[int] = field(default_factory=list)

    def inc(self) -> None:
        RAN.append(self.i)
        self.i += 1

    def definition(self) -> Section:
        return S(For("loop", self.i < self.upto, Step("inc", self.inc)))


class GatedStore:
    """Wraps a store's `checkpoint`: the first write of `i >= at` waits for a gate, may fail."""

    def __init__(self, store: SQLiteStore, at: int) -> None:
        self.store, self.at = store, at
        self.gate = anyio.Event()
        self.fail_once = False
        self.waiting = False
        #: ("durable" or "failed", status, i) per write, ("ended",) per end notification.
        self.events: list[tuple[Any, ...]] = []
        self._checkpoint = store.checkpoint
        store.checkpoint = self.checkpoint  # type: ignore[method-assign]

    async def checkpoint(self, workflow_id: str, **fields: Any) -> None:
        i = int(fields["data"].split('"i":')[1].split(",")[0].split("}")[0])
        if i >= self.at and not self.gate.is_set():
            self.waiting = True
            await self.gate.wait()
            if self.fail_once:
                self.fail_once = False
                self.events.append(("failed", fields["status"], i))
                raise sqlite3.OperationalError("database is locked")
        await self._checkpoint(workflow_id, **fields)
        self.events.append(("durable", fields["status"], i))


class TestActorPipeline:
    """An actor runs the next step while its checkpoint commits, and acknowledges on durability."""

    async def test_next_steps_run_while_a_checkpoint_commits(self, tmp_path: Path) -> None:
        """With the write of step 3 held, later steps run; the end waits for it."""
        RAN.clear()
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            gated = GatedStore(store, at=3)
            async with Runtime.open(store, {"Steady": Steady}, Settings()) as rt:
                rt.on_ended = lambda: gated.events.append(("ended",))
                await rt.start("Steady", "s", {"upto": 10})
                await until(lambda: gated.waiting and len(RAN) == 10)
                row = await store.get("s")
                assert row is not None and row.status != "Finished"
                assert ("ended",) not in gated.events
                gated.gate.set()
                await wait_runtime_status(rt, "s", "Finished")
        assert list(range(10)) == RAN  # each once: nothing was lost
        ends = [n for n, e in enumerate(gated.events) if e == ("ended",)]
        finished = [n for n, e in enumerate(gated.events) if e[:2] == ("durable", "Finished")]
        assert ends and finished and finished[0] < ends[0]

    async def test_a_failed_write_goes_back_to_the_durable_state(self, tmp_path: Path) -> None:
        """Steps run past a write that then fails are dropped and run again; no early end."""
        RAN.clear()
        clock = FakeClock()
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            gated = GatedStore(store, at=3)
            gated.fail_once = True
            async with Runtime.open(store, {"Steady": Steady}, Settings(), clock=clock) as rt:
                rt.on_ended = lambda: gated.events.append(("ended",))
                await rt.start("Steady", "s", {"upto": 10})
                await until(lambda: gated.waiting and len(RAN) == 10)
                gated.gate.set()

                async def finished() -> bool:
                    clock.advance(5)  # past the back-off
                    row = await store.get("s")
                    return row is not None and row.status == "Finished"

                await eventually(finished)
                shown = await wait_runtime_status(rt, "s", "Finished")
        assert shown["data"]["i"] == 10
        # The steps durable before the failing write never run again; the rest run twice.
        failed = gated.events.index(next(e for e in gated.events if e[0] == "failed"))
        before = gated.events[:failed]
        assert all(e[0] == "durable" for e in before)
        durable_i = before[-1][2] if before else 0  # else: as the workflow was created
        assert 0 <= durable_i < 3
        assert [*range(10), *range(durable_i, 10)] == RAN
        ends = [n for n, e in enumerate(gated.events) if e == ("ended",)]
        finished_at = [n for n, e in enumerate(gated.events) if e[:2] == ("durable", "Finished")]
        assert ends and finished_at and finished_at[0] < ends[0]
