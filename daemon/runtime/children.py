"""The runtime's side of Child cases: start a child, tell its parent how it ended, cancel it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from daemon.core.state import FINAL_STATUSES
from daemon.core.workflow import Workflow
from daemon.errors import Conflict, WorkflowNotFound
from daemon.store.base import Store, WorkflowRow

log = structlog.get_logger()
#: Starts a workflow: (workflow, workflow_id, input, parent).
Start = Callable[[str, str, dict[str, Any] | None, str], Awaitable[object]]
#: Cancels a workflow by id.
Cancel = Callable[[str], Awaitable[object]]
#: Returns the registered class of a workflow type, or None.
TypeOf = Callable[[str], type[Workflow] | None]


class ChildLinks:
    """Implements daemon.core.children.Children for the running daemon.

    A parent learns that a child ended from `ended`, which the child's actor calls once the
    end is durable; the store is read after registering, so an end is never missed.
    """

    def __init__(self, *, store: Store, start: Start, cancel: Cancel, type_of: TypeOf) -> None:
        self._store, self._start, self._cancel, self._type_of = store, start, cancel, type_of
        self._ended: dict[str, asyncio.Event] = {}

    async def start(
        self, *, parent: str, workflow: str, workflow_id: str, input: dict[str, Any] | None
    ) -> None:
        """Start the child; one that exists (a retried or recovered setup) is left as it is.

        An existing workflow that is not this parent's child is refused: adopting it would let
        the parent cancel what it never started (or its own ancestor, a cycle).
        """
        await self._start(workflow, workflow_id, input, parent)
        row = await self._store.get(workflow_id)
        if row is not None and row.parent != parent:
            raise Conflict(f"workflow {workflow_id!r} exists and is not a child of {parent!r}")

    async def outcome(self, workflow_id: str) -> dict[str, Any]:
        """Wait until the workflow has ended; return `{workflow_id, status, result, error}`."""
        while True:
            event = self._ended.setdefault(workflow_id, asyncio.Event())
            row = await self._store.get(workflow_id)
            if row is None or row.status in FINAL_STATUSES:
                return self._outcome(workflow_id, row)
            await event.wait()

    async def cancel(self, workflow_id: str) -> None:
        """Cancel the workflow if it still runs; one that is gone needs nothing."""
        with contextlib.suppress(WorkflowNotFound):
            await self._cancel(workflow_id)

    def ended(self, workflow_id: str) -> None:
        """Wake whoever waits for this workflow's end."""
        event = self._ended.pop(workflow_id, None)
        if event is not None:
            event.set()

    def _outcome(self, workflow_id: str, row: WorkflowRow | None) -> dict[str, Any]:
        if row is None:  # deleted (gc) before its parent looked
            gone = f"no workflow {workflow_id!r}"
            return {"workflow_id": workflow_id, "status": None, "result": None, "error": gone}
        result, error = self._result(row)
        return {
            "workflow_id": workflow_id,
            "status": row.status,
            "result": result,
            "error": row.error if error is None else error,
        }

    def _result(self, row: WorkflowRow) -> tuple[Any, str | None]:
        """Return the child's `result()` if its class defines one, else its data."""
        data = msgspec.json.decode(row.data)
        cls = self._type_of(row.name)
        fn = getattr(cls, "result", None) if cls is not None else None
        if cls is None or not callable(fn):
            return data, None
        try:
            value = cls.from_json(row.data).result()  # type: ignore[attr-defined]
            return msgspec.to_builtins(value), None
        except Exception as e:  # noqa: BLE001 - user code: its failure goes to the parent
            log.warning("child_result_failed", workflow_id=row.id, error=f"{type(e).__name__}: {e}")
            return None, f"result() raised {type(e).__name__}: {e}"


async def composition(store: Store, row: WorkflowRow) -> dict[str, Any]:
    """Return what `show` tells of a workflow's parent, children, deadline and last command."""
    kids = await store.list(parent=row.id, limit=1000)
    out: dict[str, Any] = {
        "parent": row.parent,
        "children": [
            {"workflow_id": k.id, "workflow": k.name, "status": k.status}
            for k in sorted(kids, key=lambda k: k.created_at)
        ],
        "deadline": row.deadline,
    }
    runs = [h for h in await store.history(row.id, limit=100) if h.kind == "command_run"]
    if runs:
        out["last_run"] = {"at": runs[-1].at, **runs[-1].detail}
    return out
