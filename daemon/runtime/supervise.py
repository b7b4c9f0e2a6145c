"""Keeps a background task alive: a failure is logged and retried with backoff, never fatal."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NoReturn

import anyio
import structlog

log = structlog.get_logger()
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 60.0


async def supervise(
    task: str,
    work: Callable[[], Awaitable[object]],
    pause: Callable[[], Awaitable[object]],
    *,
    initial_s: float = RETRY_INITIAL_S,
    max_s: float = RETRY_MAX_S,
) -> NoReturn:
    """Call `work`, then `pause` until the next round, until cancelled; a failure is retried.

    The daemon's background tasks (retention, the janitor, the status line, the timers) all run
    under it, so nothing they meet (a locked or full database, a bug) can end the process. A
    failure is logged as `task_failed` and the round is tried again after a delay that doubles
    with each failure in a row, from `initial_s` up to `max_s`; the first `work` that succeeds
    after failures logs `task_recovered`.
    """
    failures = 0
    while True:
        try:
            await work()
            if failures:
                log.info("task_recovered", task=task, failures=failures)
                failures = 0
            await pause()
        except Exception as e:  # noqa: BLE001 - a background task must never end the process
            failures += 1
            delay = min(initial_s * 2 ** (failures - 1), max_s)
            log.error(
                "task_failed",
                task=task,
                error=f"{type(e).__name__}: {e}",
                failures=failures,
                retry_in_s=delay,
            )
            await anyio.sleep(delay)
