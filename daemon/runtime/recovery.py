"""Recovery: every unfinished workflow is checked against the code, then resumed, re-armed or held.

The same check as a reload's (daemon.core.compat): a workflow that does not fit the code, or
whose row does not decode, is held with the reason rather than run into a failure, until a
reload, a restart or a repair makes it fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from daemon.core.compat import misfit
from daemon.core.handler import CallbackRequest
from daemon.core.state import FINAL_STATUSES, EventStatus, WorkflowStatus
from daemon.errors import WorkflowdError
from daemon.runtime.arming import Arms
from daemon.runtime.cache import Cache
from daemon.runtime.scheduler import Scheduler
from daemon.runtime.work import Item
from daemon.store.base import Store, WorkflowRow

log = structlog.get_logger()


class Recovery:
    """Brings stored workflows into motion, or holds those that cannot run under this code."""

    def __init__(
        self,
        *,
        store: Store,
        cache: Cache,
        scheduler: Scheduler,
        arms: Arms,
        deadline: Callable[[str, float], None] = lambda workflow_id, at: None,
    ) -> None:
        self._store, self._cache, self._scheduler, self._arms = store, cache, scheduler, arms
        #: Arms a workflow's deadline (`timeout_s`), which holds even while it is held.
        self._deadline = deadline

    async def recover(self) -> None:
        """Pick up every unfinished workflow: resume runnable ones, re-arm waiting ones.

        Each is checked against the code first; one that does not fit is held with the reason.
        """
        counts = dict.fromkeys(("resumed", "armed", "broken", "incompatible", "held"), 0)
        pending = await self._store.inbox_pending()
        unseen = {p.workflow_id for p in pending}
        async for row in self._store.unfinished():
            unseen.discard(row.id)
            counts[await self.recover_one(row)] += 1
        # Ids that are not unfinished: ended ones reject their events; missing ones cannot.
        gone = {wid for wid in unseen if await self._store.get(wid) is None}
        dropped: list[int] = []
        for pending_row in pending:
            if pending_row.workflow_id in gone:
                log.warning(
                    "inbox_dropped",
                    inbox_id=pending_row.id,
                    workflow_id=pending_row.workflow_id,
                    event_name=pending_row.event,
                    reason="no such workflow",
                )
                dropped.append(pending_row.id)
                continue
            req = CallbackRequest(
                pending_row.workflow_id, pending_row.thread_id, pending_row.event, pending_row.pc
            )
            self._scheduler.submit(
                pending_row.workflow_id,
                Item("callback", req=req, input=pending_row.input, inbox_id=pending_row.id),
            )
        if dropped:
            await self._store.inbox_done(dropped)
        log.info("recovered", **counts)

    async def recover_one(self, row: WorkflowRow) -> str:
        """Resume or re-arm one unfinished workflow that fits the code; return what was done.

        "resumed" or "armed"; "held" by `workflowd --hold`; "incompatible" (it does not fit
        the code) or "broken" (its row does not decode, or its waits cannot be armed).
        """
        hold = self._scheduler.hold
        if row.deadline is not None:
            self._deadline(row.id, row.deadline)
        try:
            loaded = self._cache.decode(row)
        except WorkflowdError as e:
            self._hold_unfit(row, str(e))
            log.error("workflow_corrupt", workflow_id=row.id, workflow=row.name, error=str(e))
            return "broken"
        reason = misfit(self._cache.registry, row.name, row.data, loaded.state)
        if reason is not None:
            self._hold_unfit(row, reason)
            log.error("workflow_incompatible", workflow_id=row.id, workflow=row.name, reason=reason)
            return "incompatible"
        if hold.incompatible.pop(row.id, None) is not None:
            log.info("workflow_fits", workflow_id=row.id, workflow=row.name)
        if hold.holds(row.id):
            return "held"
        state = loaded.state
        needs_setup = any(
            ev.status is not EventStatus.SETUP for t in state.threads for ev in t.wait_events
        )
        if state.status is WorkflowStatus.RESUMING or needs_setup:
            self._cache.remember(loaded)
            self._scheduler.submit(row.id, Item("resume"))
            return "resumed"
        try:
            self._arms.rearm(loaded.wf, loaded.state)
        except Exception as e:  # noqa: BLE001 - one bad definition must not stop recovery
            log.error("workflow_rearm_failed", workflow_id=row.id, error=str(e))
            return "broken"
        return "armed"

    def _hold_unfit(self, row: WorkflowRow, reason: str) -> None:
        """Hold a workflow that cannot run under this code: nothing armed, nothing resumed."""
        self._scheduler.hold.incompatible[row.id] = reason
        self._arms.disarm_workflow(row.id)

    async def refit(self) -> list[dict[str, Any]]:
        """Check the workflows held as unfit against the code now registered; return the rest.

        One that fits now is released (armed, resumed, and its parked events applied).
        """
        hold, still = self._scheduler.hold, []
        for wid in list(hold.incompatible):
            # A repair changing it checks it against this code itself; an actor on a held
            # workflow can only be cancelling it.
            if wid in hold.busy or self._scheduler.running(wid):
                continue
            row = await self._store.get(wid)
            if row is None or row.status in FINAL_STATUSES:  # cancelled meanwhile
                hold.incompatible.pop(wid, None)
                continue
            await self.recover_one(row)
            reason = hold.incompatible.get(wid)
            if reason is None:
                self._scheduler.unpark(wid)
            else:
                still.append({"workflow_id": wid, "workflow": row.name, "reason": reason})
        return still
