"""Interruptible: a plain task cancel that ends the block, and only the block."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from daemon.runtime.interrupt import Interruptible


async def test_a_cancel_ends_the_block_and_the_task_goes_on() -> None:
    region = Interruptible()
    reached: list[str] = []

    async def body() -> str:
        async with region:
            reached.append("in")
            await asyncio.Event().wait()  # until interrupted
            reached.append("never")
        await asyncio.sleep(0)  # no cancel is left pending for what follows
        return "after"

    task = asyncio.get_running_loop().create_task(body())
    await asyncio.sleep(0)
    region.cancel()
    assert await asyncio.wait_for(task, 5) == "after"
    assert reached == ["in"]
    assert region.cancelled_caught
    assert task.cancelling() == 0


async def test_a_cancel_from_elsewhere_goes_on_out_of_the_block() -> None:
    region = Interruptible()

    async def body() -> None:
        async with region:
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(body())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert not region.cancelled_caught


async def test_both_cancels_end_the_task() -> None:
    region = Interruptible()

    async def body() -> None:
        async with region:
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(body())
    await asyncio.sleep(0)
    region.cancel()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_a_swallowed_cancel_is_not_left_pending() -> None:
    region = Interruptible()

    async def body() -> str:
        async with region:
            # Code that swallows it: the block then ends on its own.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        await asyncio.sleep(0)
        return "after"

    task = asyncio.get_running_loop().create_task(body())
    await asyncio.sleep(0)
    region.cancel()
    assert await asyncio.wait_for(task, 5) == "after"
    assert task.cancelling() == 0


async def test_a_cancel_not_yet_delivered_is_taken_by_the_block() -> None:
    region = Interruptible()

    async def body() -> str:
        async with region:
            region.cancel()  # pending: the task has not awaited anything since
        await asyncio.sleep(0)
        return "after"

    assert await asyncio.wait_for(body(), 5) == "after"
    assert region.cancelled_caught


async def test_a_cancel_outside_the_block_does_nothing() -> None:
    region = Interruptible()
    region.cancel()
    async with region:
        await asyncio.sleep(0)
    region.cancel()
    await asyncio.sleep(0)
    assert not region.cancelled_caught
