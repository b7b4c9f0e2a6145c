"""Whole-workflow deadlines (`timeout_s`): one heap, and a cancel when one passes."""

from __future__ import annotations

import heapq
import math
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import structlog

from daemon.clock import Clock
from daemon.runtime.supervise import supervise

log = structlog.get_logger()
#: The error a workflow is cancelled with when its deadline passes.
DEADLINE_PASSED = "deadline passed"
#: Cancels a workflow with an error text.
Expire = Callable[[str, str], Awaitable[object]]


class Deadlines:
    """Cancels each workflow whose deadline has passed, with error `deadline passed`."""

    def __init__(self, tg: anyio.abc.TaskGroup, clock: Clock, expire: Expire) -> None:
        self._tg, self._clock, self._expire = tg, clock, expire
        self._heap: list[tuple[float, str]] = []
        self._due: dict[str, float] = {}
        self._wake = anyio.Event()

    def add(self, workflow_id: str, deadline: float) -> None:
        """Cancel the workflow at `deadline` (epoch seconds) unless it has ended by then."""
        if self._due.get(workflow_id) == deadline:
            return
        self._due[workflow_id] = deadline
        heapq.heappush(self._heap, (deadline, workflow_id))
        if self._heap[0][1] == workflow_id:
            self._wake.set()

    def next_due(self) -> float:
        """Return when (epoch seconds) the earliest deadline may pass; inf with none."""
        return self._heap[0][0] if self._heap else math.inf

    async def run(self) -> None:
        """Cancel workflows as their deadlines pass; runs until cancelled."""
        await supervise("deadlines", self._fire_due, self._until_due)

    async def _until_due(self) -> None:
        self._wake = anyio.Event()
        if not self._heap:
            await self._wake.wait()
            return
        async with anyio.create_task_group() as tg:

            async def sleeper() -> None:
                await self._clock.sleep_until(self._heap[0][0])
                tg.cancel_scope.cancel()

            tg.start_soon(sleeper)
            await self._wake.wait()
            tg.cancel_scope.cancel()

    async def _fire_due(self) -> None:
        now = self._clock.now()
        while self._heap and self._heap[0][0] <= now:
            deadline, wid = heapq.heappop(self._heap)
            if self._due.get(wid) != deadline:
                continue
            del self._due[wid]
            # A task each: cancelling one workflow (and its children) must not hold up another.
            self._tg.start_soon(self._cancel, wid)

    async def _cancel(self, workflow_id: str) -> None:
        try:
            await self._expire(workflow_id, DEADLINE_PASSED)
        except Exception as e:  # noqa: BLE001 - e.g. the store is failing: try again soon
            log.warning(
                "deadline_cancel_failed", workflow_id=workflow_id, error=str(e), retry_in_s=5.0
            )
            self.add(workflow_id, self._clock.now() + 5.0)
