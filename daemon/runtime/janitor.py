"""Retries the teardowns that failed when a workflow ended, so no handler resource outlives it."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import structlog

from daemon.core.waits import teardown_ended
from daemon.errors import WorkflowdError
from daemon.runtime.cache import Cache
from daemon.runtime.supervise import supervise
from daemon.store.base import Store

log = structlog.get_logger()
RETRY_INITIAL_S = 60.0
RETRY_MAX_S = 3600.0


class Janitor:
    """Sweeps ended workflows whose teardown failed: at start, when told, then with backoff."""

    def __init__(self, *, store: Store, cache: Cache, skip: Callable[[str], bool]) -> None:
        self._store, self._cache = store, cache
        #: Workflows not to touch now: being saved (the next sweep sees them), or held.
        self._skip = skip
        self._wake = anyio.Event()
        #: Teardowns still failing after the last sweep, and the wait before the next one.
        self._left, self._delay = 0, RETRY_INITIAL_S

    def wake(self) -> None:
        """Ask for a sweep soon (an ended workflow kept a failed teardown)."""
        self._wake.set()

    async def sweep(self) -> int:
        """Retry every failed teardown of ended workflows once; return how many still fail."""
        left = 0
        for row in await self._store.ended_with_teardown_errors():
            if self._skip(row.id):
                continue
            try:
                loaded = self._cache.decode(row)
            except WorkflowdError:
                continue  # a corrupt row is reported by recovery
            still = await teardown_ended(loaded.wf, loaded.state)
            await self._store.checkpoint(
                row.id,
                status=row.status,
                data=row.data,
                state=loaded.state.to_json(),
                error=row.error,
                attempt=row.attempt,
                history=[("teardown_retried", {"still_failing": still})],
            )
            self._cache.forget(row.id)
            log.info("teardown_retried", workflow_id=row.id, still_failing=still)
            left += still
        return left

    async def run(self) -> None:
        """Sweep now, then whenever woken; while teardowns keep failing, retry with backoff."""
        await supervise("janitor", self._sweep_round, self._pause)

    async def _sweep_round(self) -> None:
        self._wake = anyio.Event()  # a wake-up from now on asks for another sweep
        self._left = await self.sweep()

    async def _pause(self) -> None:
        if not self._left:
            self._delay = RETRY_INITIAL_S
            await self._wake.wait()
            return
        with anyio.move_on_after(self._delay):
            await self._wake.wait()
        self._delay = min(self._delay * 2, RETRY_MAX_S)
