"""An in-memory control backend and a way to serve it on a real socket inside the test process.

The control server and workflowctl are tested against `MemoryBackend` (a real fake of the
runtime's `Backend` protocol); a child process can serve it too (`python -c`, importing this
module), since nothing here is a test file.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from daemon.control.dispatch import Backend
from daemon.control.server import serve
from daemon.errors import (
    CallbackNotFound,
    Conflict,
    HandlerRejected,
    StaleCallback,
    UnknownWorkflowType,
    WorkflowNotFound,
)

Record = dict[str, Any]
Records = list[Record]  # `list` is shadowed inside MemoryBackend


class Unprintable:
    """A value that cannot be turned into JSON, not even through str()."""

    def __str__(self) -> str:
        raise ValueError("no text form")


class MemoryBackend:
    """A real in-memory stand-in for the runtime: workflow types, waits, history and logs."""

    def __init__(self, events: tuple[str, ...] = ("approve", "reject", "crash", "odd")) -> None:
        #: Workflow type -> the events a new workflow of that type waits for.
        self.kinds = {"approval": events}
        self.workflows: dict[str, Record] = {}
        self.histories: dict[str, list[Record]] = {}
        self.records: list[Record] = []
        self.subscribers: set[tuple[str | None, MemoryObjectSendStream[Record]]] = set()
        self.hold: anyio.Event | None = None  # when set, `send` waits for it
        self.started = 0

    def emit(self, event: str, **fields: Any) -> None:
        """Keep a log record and hand it to every live subscriber that wants it."""
        record = {"event": event, **fields}
        self.records.append(record)
        for wanted, stream in list(self.subscribers):
            if wanted in (None, record.get("workflow_id")):
                with suppress(
                    anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError
                ):
                    stream.send_nowait(record)

    def _get(self, workflow_id: str) -> Record:
        if workflow_id not in self.workflows:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        return self.workflows[workflow_id]

    def _note(self, workflow_id: str, kind: str, detail: Any = None) -> None:
        history = self.histories.setdefault(workflow_id, [])
        history.append({"seq": len(history) + 1, "kind": kind, "detail": detail})

    async def start(
        self,
        workflow: str,
        workflow_id: str | None = None,
        input: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Create a workflow waiting for its type's events."""
        if workflow not in self.kinds:
            raise UnknownWorkflowType(f"no workflow type {workflow!r}")
        self.started += 1
        wid = workflow_id or f"{workflow}-{self.started}"
        if wid in self.workflows:
            raise Conflict(f"workflow {wid!r} already exists")
        self.workflows[wid] = {
            "workflow_id": wid,
            "workflow": workflow,
            "status": "Waiting",
            "updated_at": f"2024-01-01T00:{self.started // 60:02d}:{self.started % 60:02d}Z",
            "waiting_for": list(self.kinds[workflow]),
            "pc": 1,
            "data": dict(input or {}),
        }
        self._note(wid, "started", input)
        self.emit("workflow_started", workflow_id=wid)
        return {"workflow_id": wid, "status": "Waiting"}

    def send_now(
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
    ) -> None:
        """Leave every send to `send` (the fake has no queue to put it on)."""

    async def send(
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
        wait: bool = True,
    ) -> Any:
        """Deliver an event the way the runtime would check it."""
        wf = self._get(workflow_id)
        if wf["status"] != "Waiting":
            raise Conflict(f"workflow {workflow_id!r} is {wf['status']}")
        if event not in wf["waiting_for"] or thread_id not in (None, "main"):
            raise CallbackNotFound(f"{workflow_id!r} does not wait for {event!r}")
        if pc is not None and pc != wf["pc"]:
            raise StaleCallback(f"pc {pc} is stale (now {wf['pc']})")
        if event == "crash":
            raise RuntimeError("the backend broke")
        if event == "odd":
            return {"value": Unprintable()}
        if event == "approve" and not isinstance(input, str):
            raise HandlerRejected("approve needs the reviewer's name (a string)")
        if self.hold is not None:
            await self.hold.wait()
        wf.update(status="Finished", waiting_for=[], pc=wf["pc"] + 1)
        self._note(workflow_id, event, input)
        self.emit("event_handled", workflow_id=workflow_id, name=event)
        return {"handled": event, "input": input}

    async def list(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        parent: str | None = None,
    ) -> Records:
        """List workflows newest first."""
        keys = ("workflow_id", "workflow", "status", "updated_at", "waiting_for")
        rows = [
            {k: wf[k] for k in keys}
            for wf in self.workflows.values()
            if status in (None, wf["status"]) and workflow in (None, wf["workflow"])
        ]
        return sorted(rows, key=lambda r: r["updated_at"], reverse=True)[:limit]

    async def page(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        after: tuple[float, int] | None = None,
        parent: str | None = None,
    ) -> tuple[Records, tuple[float, int] | None]:
        """List a page of workflows newest first; the position is an offset (enough for a fake)."""
        rows = await self.list(
            status=status, workflow=workflow, limit=len(self.workflows), parent=parent
        )
        start = 0 if after is None else after[1]
        end = start + limit
        return rows[start:end], ((0.0, end) if end < len(rows) else None)

    async def show(self, workflow_id: str) -> dict[str, Any]:
        """Return a copy of one workflow."""
        return dict(self._get(workflow_id))

    async def history(self, workflow_id: str, *, limit: int = 1000) -> Records:
        """Return one workflow's history."""
        self._get(workflow_id)
        return self.histories[workflow_id][-limit:]

    async def cancel(self, workflow_id: str) -> dict[str, Any]:
        """Cancel a waiting workflow."""
        wf = self._get(workflow_id)
        if wf["status"] != "Waiting":
            raise Conflict(f"workflow {workflow_id!r} is already {wf['status']}")
        wf.update(status="Cancelled", waiting_for=[])
        self._note(workflow_id, "cancelled")
        return {"workflow_id": workflow_id, "status": "Cancelled"}

    async def counts(self) -> dict[str, int]:
        """Count workflows by status."""
        return dict(Counter(wf["status"] for wf in self.workflows.values()))

    def busy(self) -> int:
        """Count the workflows at work: none, in memory."""
        return 0

    def incompatible(self) -> int:
        """Count the workflows held for not fitting the code: none, in memory."""
        return 0

    async def wait(
        self,
        workflow_ids: Sequence[str],
        *,
        any: bool = False,
        timeout_s: float | None = None,
        until: str = "ended",
    ) -> dict[str, Any]:
        """Report where the workflows stand at once (nothing moves in memory on its own)."""
        rows = [self._get(wid) for wid in workflow_ids]
        out = [{**r, "ended": r["status"] != "Waiting", "result": r.get("data")} for r in rows]
        ended = [r for r in out if r["ended"]]
        return {"workflows": out, "timed_out": not (ended if any else len(ended) == len(out))}

    def types(self) -> Records:
        """Describe the one workflow type."""
        return [{"workflow": name, "doc": "", "fields": []} for name in self.kinds]

    @asynccontextmanager
    async def subscribe_logs(
        self, workflow_id: str | None = None, *, follow: bool = True
    ) -> AsyncIterator[AsyncIterator[Record]]:
        """Yield the kept records, then (with follow) live ones."""
        send, receive = anyio.create_memory_object_stream[Record](10_000)
        for record in self.records:
            if workflow_id in (None, record.get("workflow_id")):
                send.send_nowait(record)
        entry = (workflow_id, send)
        if follow:
            self.subscribers.add(entry)
        else:
            send.close()
        try:
            with send, receive:
                yield receive
        finally:
            self.subscribers.discard(entry)


def _conforms(backend: MemoryBackend) -> Backend:
    return backend  # mypy checks here that MemoryBackend satisfies the Backend protocol


@asynccontextmanager
async def serving(backend: MemoryBackend, path: Path, **options: Any) -> AsyncIterator[Path]:
    """Run serve() in the background for the duration of the block."""
    async with anyio.create_task_group() as tg:
        await tg.start(functools.partial(serve, backend, socket_path=path, **options))
        yield path
        tg.cancel_scope.cancel()
