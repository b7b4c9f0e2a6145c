"""The scheduler in process: actors run as plain asyncio tasks that `Scheduler.run` hosts.

Cancelling `run` cancels every actor and waits for it; an actor that raises ends `run` with
its error, as a task group's child would end the group. The actors are real `Actor`s whose
`run` is replaced, on a real runtime's parts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from daemon.runtime.actor import Actor
from daemon.runtime.pipeline import Save
from daemon.runtime.runtime import Runtime
from daemon.runtime.scheduler import Hold, Scheduler
from daemon.runtime.work import Item
from daemon.store.sqlite import SQLiteStore
from tests.helpers.wait import until


@dataclass(eq=False, kw_only=True)
class Crashing(Actor):
    """An actor whose run raises, as a bug outside its own guards would."""

    async def run(self) -> None:
        await anyio.lowlevel.checkpoint()
        raise RuntimeError("boom")


@dataclass(eq=False, kw_only=True)
class Hanging(Actor):
    """An actor that runs until cancelled, noting that it started and that it was cancelled."""

    notes: list[str]

    async def run(self) -> None:
        self.notes.append("started")
        try:
            await anyio.sleep_forever()
        finally:
            self.notes.append("cancelled")


@dataclass(eq=False, kw_only=True)
class Stubborn(Actor):
    """An actor that awaits again after its first cancellation (as one settling a write does)."""

    notes: list[str]

    async def run(self) -> None:
        self.notes.append("started")
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError:
            self.notes.append("told once")
            await anyio.sleep_forever()  # until told again
        finally:
            self.notes.append("ended")


@dataclass(eq=False, kw_only=True)
class Committing(Actor):
    """An actor that awaits its own write (Pipeline.commit) until `gate` opens, then hangs."""

    notes: list[str]
    gate: anyio.Event

    async def _write(self, save: Save) -> None:
        self.notes.append("writing")
        await self.gate.wait()
        self.notes.append("written")

    async def run(self) -> None:
        save = Save("Waiting", "{}", "{}", None, 0, None, [])
        await self._pipeline.commit(save)
        self.notes.append("durable")
        try:
            await anyio.sleep_forever()
        finally:
            self.notes.append("cancelled")


def _scheduler(rt: Runtime, make: Callable[..., Actor]) -> Scheduler:
    return Scheduler(
        cache=rt.cache,
        hold=Hold(False),
        new_actor=lambda wid: make(
            workflow_id=wid,
            store=rt.store,
            cache=rt.cache,
            arms=rt.arms,
            clock=rt.clock,
            settings=rt.settings,
            limiter=rt.limiter,
            on_leftover=lambda: None,
        ),
    )


class TestActorTasks:
    """Each actor is one asyncio task, owned by `Scheduler.run`."""

    async def test_an_actor_is_a_plain_asyncio_task(self, tmp_path: Path) -> None:
        """Submitting work starts one task for the workflow; its second item reuses it."""
        notes: list[str] = []
        async with SQLiteStore.open(tmp_path / "wf.db") as store, Runtime.open(store, {}) as rt:
            scheduler = _scheduler(rt, lambda **kw: Hanging(notes=notes, **kw))
            async with anyio.create_task_group() as tg:
                tg.start_soon(scheduler.run)
                before = len(asyncio.all_tasks())
                scheduler.submit("w", Item("resume"))
                scheduler.submit("w", Item("resume"))
                assert len(asyncio.all_tasks()) == before + 1
                await until(lambda: notes == ["started"])
                assert scheduler.running("w") and len(scheduler) == 1
                tg.cancel_scope.cancel()
        assert notes == ["started", "cancelled"]
        assert not scheduler.running("w")

    async def test_cancelling_run_cancels_every_actor_and_waits(self, tmp_path: Path) -> None:
        """Once `run` returns from its cancellation, every actor has been cancelled and ended."""
        notes: list[str] = []
        async with SQLiteStore.open(tmp_path / "wf.db") as store, Runtime.open(store, {}) as rt:
            scheduler = _scheduler(rt, lambda **kw: Hanging(notes=notes, **kw))
            async with anyio.create_task_group() as tg:
                tg.start_soon(scheduler.run)
                for i in range(20):
                    scheduler.submit(f"w{i}", Item("resume"))
                await until(lambda: notes.count("started") == 20)
                tg.cancel_scope.cancel()
            assert notes.count("cancelled") == 20
            assert len(scheduler) == 0
            with anyio.fail_after(5):
                await scheduler.wait_idle()

    async def test_actors_cancelled_before_their_first_turn_are_forgotten(
        self, tmp_path: Path
    ) -> None:
        """Work submitted just before the cancel: `run` still ends, and no actor is left."""
        notes: list[str] = []
        async with SQLiteStore.open(tmp_path / "wf.db") as store, Runtime.open(store, {}) as rt:
            scheduler = _scheduler(rt, lambda **kw: Hanging(notes=notes, **kw))
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(scheduler.run)
                    await anyio.lowlevel.checkpoint()  # `run` is hosting
                    tg.cancel_scope.cancel()
                    # Their first turns are queued behind `run`'s, which the cancel queued:
                    # `run` cancels these actors' tasks before any of them has had a turn.
                    for i in range(20):
                        scheduler.submit(f"w{i}", Item("resume"))
                await scheduler.wait_idle()
            assert notes == [] and len(scheduler) == 0 and not scheduler.running("w0")

    async def test_an_actor_that_awaits_after_a_cancel_is_cancelled_again(
        self, tmp_path: Path
    ) -> None:
        """Cancellation is not a single shot: an actor awaiting in its cleanup is told again."""
        notes: list[str] = []
        async with SQLiteStore.open(tmp_path / "wf.db") as store, Runtime.open(store, {}) as rt:
            scheduler = _scheduler(rt, lambda **kw: Stubborn(notes=notes, **kw))
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(scheduler.run)
                    scheduler.submit("w", Item("resume"))
                    await until(lambda: notes == ["started"])
                    tg.cancel_scope.cancel()
            assert notes == ["started", "told once", "ended"] and len(scheduler) == 0

    async def test_an_actor_awaiting_its_own_write_is_cancelled_once_it_is_in(
        self, tmp_path: Path
    ) -> None:
        """Shutdown does not cut an actor off from the outcome of the write it awaits."""
        notes: list[str] = []
        gate = anyio.Event()
        async with SQLiteStore.open(tmp_path / "wf.db") as store, Runtime.open(store, {}) as rt:
            scheduler = _scheduler(rt, lambda **kw: Committing(notes=notes, gate=gate, **kw))
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(scheduler.run)
                    scheduler.submit("w", Item("resume"))
                    await until(lambda: notes == ["writing"])
                    # Opened after `run` has begun cancelling (the write outlives that turn).
                    asyncio.get_running_loop().call_later(0.2, gate.set)
                    tg.cancel_scope.cancel()
            assert notes == ["writing", "written", "durable", "cancelled"]
            assert len(scheduler) == 0

    async def test_an_actor_that_raises_ends_run_with_its_error(self, tmp_path: Path) -> None:
        """A crash is not swallowed: `run` raises it (the runtime's task group then ends)."""
        async with SQLiteStore.open(tmp_path / "wf.db") as store, Runtime.open(store, {}) as rt:
            scheduler = _scheduler(rt, Crashing)
            scheduler.submit("w", Item("resume"))
            with anyio.fail_after(5), pytest.raises(RuntimeError, match="boom"):
                await scheduler.run()
            assert not scheduler.running("w")


class TestActorExit:
    """`Actor.wait_done` returns once the scheduler has said that the actor exited."""

    async def test_waiters_before_and_after_the_exit_return(self, tmp_path: Path) -> None:
        """A waiter from before the exit is woken; one after it returns at once."""
        notes: list[str] = []
        async with SQLiteStore.open(tmp_path / "wf.db") as store, Runtime.open(store, {}) as rt:
            scheduler = _scheduler(rt, lambda **kw: Hanging(notes=notes, **kw))
            actor = scheduler._new_actor("w")
            woken: list[str] = []

            async def wait(name: str) -> None:
                await actor.wait_done()
                woken.append(name)

            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(wait, "early")
                    with anyio.move_on_after(0.01):  # a cancelled waiter spoils nobody's wait
                        await actor.wait_done()
                    await anyio.lowlevel.checkpoint()
                    assert woken == []
                    actor.exited()
                await actor.wait_done()
            assert woken == ["early"]
