"""Retries the teardowns that failed when a workflow ended, so no handler resource outlives it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import structlog

from daemon.core.engine import Definition
from daemon.core.state import EventStatus, State, WorkflowStatus
from daemon.core.workflow import Workflow
from daemon.errors import WorkflowError

if TYPE_CHECKING:
    from daemon.runtime.runtime import Runtime

log = structlog.get_logger()
RETRY_INITIAL_S = 60.0
RETRY_MAX_S = 3600.0


async def teardown_ended(wf: Workflow, state: State) -> int:
    """Tear down every wait left on an ended workflow; return how many still fail."""
    try:
        events = Definition(wf.definition()).events
    except WorkflowError:
        events = {}  # the definition itself is broken: the waits stay recorded as errors
    left = 0
    for t in state.threads:
        for ev in list(t.wait_events):
            on = events.get(ev.req.name)
            try:
                if on is None:
                    raise WorkflowError(f"event {ev.req.name!r} is not in the definition")
                await on.handler.teardown(ev.req, ev.handled)
                t.wait_events.remove(ev)
            except Exception as exc:  # noqa: BLE001 - recorded so `show` explains it
                ev.status, ev.error = EventStatus.TEARDOWN_ERROR, f"{type(exc).__name__}: {exc}"
                left += 1
    return left


class Janitor:
    """Sweeps ended workflows whose teardown failed: at start, when told, then with backoff."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._wake = anyio.Event()

    def wake(self) -> None:
        """Ask for a sweep soon (an ended workflow kept a failed teardown)."""
        self._wake.set()

    async def sweep(self) -> int:
        """Retry every failed teardown of ended workflows once; return how many still fail."""
        left = 0
        for row in await self.rt.store.ended_with_teardown_errors():
            if row.id in self.rt.actors or self.rt.hold.holds(row.id):
                continue  # being saved (the next sweep sees it), or held: no handler runs
            try:
                loaded = self.rt.decode(row)
            except WorkflowError:
                continue  # a corrupt row is reported by recovery
            still = await teardown_ended(loaded.wf, loaded.state)
            if loaded.state.status is WorkflowStatus.FINISHED:
                # As the engine does: a finished workflow keeps only threads with a failed teardown.
                loaded.state.threads = [t for t in loaded.state.threads if t.wait_events]
            detail = {"still_failing": still}
            await self.rt.store.checkpoint(
                row.id,
                status=row.status,
                data=row.data,
                state=loaded.state.to_json(),
                error=row.error,
                attempt=row.attempt,
                history=[("teardown_retried", detail)],
            )
            self.rt.forget(row.id)
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
