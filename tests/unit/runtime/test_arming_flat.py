"""The timers' flat path: on the system clock, one loop callback at the earliest deadline.

A daemon runs on the system clock, so this is the path every real timer takes (the fake clock
of tests/unit/runtime/test_arming.py goes through `Clock.sleep_until` instead). Deadlines here
are real but short; the tests wait for what must happen, with a ceiling, never for a time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import anyio.lowlevel
import structlog
from anyio.abc import TaskGroup

from daemon import CallbackRequest
from daemon.clock import SystemClock
from daemon.observe.metrics import Metrics
from daemon.runtime.arming import FIRE_BATCH, GRID_S, Arms, Fire, Key
from tests.helpers.wait import until


async def _no_submit(req: CallbackRequest, input: Any, wait: bool) -> None:
    raise AssertionError(f"no listener here, yet {req} was submitted")


def _flat(tg: TaskGroup, fire: Fire, metrics: Metrics | None = None) -> Arms:
    """Return Arms on the system clock (the flat path) that hand every fired timer to `fire`."""
    return Arms(tg, SystemClock(), _no_submit, lambda r, e: None, metrics, fire=fire)


def _keys(n: int, prefix: str = "w") -> list[Key]:
    return [(f"{prefix}{i:04d}", "_main_", "t", 1) for i in range(n)]


class TestFlat:
    """Due timers are handed over from a loop callback, in order, once, never early."""

    async def test_fire_in_deadline_order_never_early(self) -> None:
        """Timers armed in any order fire in deadline order, each once, none before its time."""
        fired: list[tuple[CallbackRequest, Any]] = []
        async with anyio.create_task_group() as tg:
            arms = _flat(tg, lambda r, i: fired.append((r, i)))
            tg.start_soon(arms.run_timers)
            now = time.time()
            keys = _keys(20)
            arms.arm_timers((k, now + 0.05 + (19 - i) / 1000) for i, k in enumerate(keys))
            arms.disarm(keys[3])
            await until(lambda: len(fired) == 19)
            assert [r.workflow_id for r, _ in fired] == [k[0] for k in keys[::-1] if k != keys[3]]
            assert all(got["fired_at"] >= got["deadline"] for _, got in fired)
            assert len(arms) == 0 and arms.armed(keys[0][0]) == set()
            tg.cancel_scope.cancel()

    async def test_timers_due_within_one_grid_step_fire_in_one_wake(self) -> None:
        """Deadlines in one step of the grid fire together at its end: never early, one wake."""
        fired: list[tuple[str, float]] = []
        async with anyio.create_task_group() as tg:
            arms = _flat(tg, lambda r, i: fired.append((r.workflow_id, i["fired_at"])))
            wakes = [0]
            fire_batch = arms._fire_batch

            def counted(now: float) -> bool:
                wakes[0] += 1
                return fire_batch(now)

            arms._fire_batch = counted  # type: ignore[method-assign]
            tg.start_soon(arms.run_timers)
            await anyio.lowlevel.checkpoint()
            # Three deadlines spread over the first half of one step, well ahead of now.
            step = (int(time.time() / GRID_S) + 50) * GRID_S
            deadlines = {f"g{i}": step + GRID_S * (0.1 + 0.2 * i) for i in range(3)}
            arms.arm_timers(((k, "_main_", "t", 1), d) for k, d in deadlines.items())
            await until(lambda: len(fired) == 3)
            assert wakes[0] == 1, fired
            assert all(at >= step + GRID_S - 1e-6 and at >= deadlines[k] for k, at in fired)
            tg.cancel_scope.cancel()

    async def test_an_earlier_timer_moves_the_wake_forward(self) -> None:
        """A timer armed while the callback waits for a later one fires first, at its time."""
        fired: list[str] = []
        async with anyio.create_task_group() as tg:
            arms = _flat(tg, lambda r, i: fired.append(r.workflow_id))
            tg.start_soon(arms.run_timers)
            await anyio.lowlevel.checkpoint()
            arms.arm_timer(("late", "_main_", "t", 1), time.time() + 3600)
            arms.arm_timer(("soon", "_main_", "t", 1), time.time() + 0.02)
            await until(lambda: fired == ["soon"])
            assert arms.next_due() > time.time() + 3000
            tg.cancel_scope.cancel()

    async def test_a_burst_is_handed_over_a_batch_per_loop_turn(self) -> None:
        """Thousands due at once go FIRE_BATCH at a time, other tasks running in between."""
        n, fired, seen = 2000, list[str](), list[int]()
        async with anyio.create_task_group() as tg:
            arms = _flat(tg, lambda r, i: fired.append(r.workflow_id))
            now = time.time()
            arms.arm_timers((k, now - 1 + i / n) for i, k in enumerate(_keys(n)))

            async def watch() -> None:
                while len(fired) < n:
                    seen.append(len(fired))
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(watch)
            tg.start_soon(arms.run_timers)
            await until(lambda: len(fired) == n)
            assert fired == [k[0] for k in _keys(n)]
            between = sorted({k for k in seen if 0 < k < n})
            assert between and all(k % FIRE_BATCH == 0 for k in between), between[:10]
            tg.cancel_scope.cancel()

    async def test_lateness_is_counted_per_fire(self) -> None:
        """Every fired timer is one observation of workflowd_timer_lateness_seconds."""
        metrics, fired = Metrics(), list[str]()
        async with anyio.create_task_group() as tg:
            arms = _flat(tg, lambda r, i: fired.append(r.workflow_id), metrics)
            tg.start_soon(arms.run_timers)
            arms.arm_timers((k, time.time() - 1) for k in _keys(FIRE_BATCH + 5))
            await until(lambda: len(fired) == FIRE_BATCH + 5)
            tg.cancel_scope.cancel()
        text = metrics.render().decode()
        assert f"workflowd_timer_lateness_seconds_count {float(FIRE_BATCH + 5)}" in text

    async def test_a_failed_hand_over_is_retried_with_the_timer_kept(self) -> None:
        """A fire that raises is logged as task_failed, kept armed, and fired on the retry."""
        calls: list[dict[str, float]] = []

        def fire(req: CallbackRequest, input: Any) -> None:
            calls.append(input)
            if len(calls) == 1:
                raise RuntimeError("queue broke")

        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                arms = _flat(tg, fire)
                tg.start_soon(arms.run_timers)
                deadline = time.time() + 0.01
                arms.arm_timer(("w", "_main_", "t", 1), deadline)
                await until(lambda: len(calls) == 1)
                assert arms.armed("w") == {("w", "_main_", "t", 1)}
                # Armed while backing off: it waits for the retry, as the timer kept does.
                arms.arm_timer(("x", "_main_", "t", 1), time.time())
                await until(lambda: len(calls) == 3)  # after the 1 s backoff
                assert arms.armed("w") == set() and len(arms) == 0
                tg.cancel_scope.cancel()
        assert calls[1]["deadline"] == deadline and calls[1]["fired_at"] >= deadline + 1
        (failed,) = [r for r in logs if r["event"] == "task_failed"]
        assert failed["task"] == "timers" and "queue broke" in failed["error"]
        (recovered,) = [r for r in logs if r["event"] == "task_recovered"]
        assert recovered["task"] == "timers" and recovered["failures"] == 1

    async def test_nothing_fires_once_stopped(self) -> None:
        """Cancelled, the loop callback is gone: a due timer armed afterwards stays armed."""
        fired: list[str] = []
        async with anyio.create_task_group() as tg:
            arms = _flat(tg, lambda r, i: fired.append(r.workflow_id))
            tg.start_soon(arms.run_timers)
            arms.arm_timer(("a", "_main_", "t", 1), time.time() + 0.05)
            await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        arms.arm_timer(("b", "_main_", "t", 1), time.time() - 1)
        await asyncio.sleep(0)  # a callback left behind would run on this turn
        loop = asyncio.get_running_loop()
        ran = asyncio.Event()
        loop.call_later(0.1, ran.set)
        await ran.wait()  # past the first timer's deadline
        assert fired == [] and len(arms) == 2
