"""Retries the teardowns that failed when a workflow ended, so no handler resource outlives it."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import structlog

from daemon.core.waits import teardown_ended
from daemon.errors import WorkflowdError
from daemon.runtime.cache import Cache
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
        delay = RETRY_INITIAL_S
        while True:
            self._wake = anyio.Event()
            try:
                left = await self.sweep()
            except Exception as e:  # noqa: BLE001 - e.g. a locked database: try again later
                log.warning("teardown_sweep_failed", error=f"{type(e).__name__}: {e}")
                left = 1
            if not left:
                delay = RETRY_INITIAL_S
                await self._wake.wait()
                continue
            with anyio.move_on_after(delay):
                await self._wake.wait()
            delay = min(delay * 2, RETRY_MAX_S)
