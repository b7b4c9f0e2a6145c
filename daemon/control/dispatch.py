"""From a decoded request to its result: one `match` over the ops, one line per verb."""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, assert_never

from daemon.control import protocol as proto
from daemon.errors import Unavailable

#: Writes one extra response line (a streamed log record) before the final answer.
Reply = Callable[[dict[str, Any]], Awaitable[None]]
Records = list[dict[str, Any]]  # `list` is shadowed inside Backend


class Backend(Protocol):
    """What the control socket needs from the runtime."""

    async def start(
        self, workflow: str, workflow_id: str | None = None, input: dict[str, Any] | None = None
    ) -> dict[str, Any]: ...
    async def send(
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
        wait: bool = True,
    ) -> Any: ...
    async def list(
        self, *, status: str | None = None, workflow: str | None = None, limit: int = 100
    ) -> Records: ...
    async def show(self, workflow_id: str) -> dict[str, Any]: ...
    async def history(self, workflow_id: str, *, limit: int = 1000) -> Records: ...
    async def cancel(self, workflow_id: str) -> dict[str, Any]: ...
    async def counts(self) -> dict[str, int]: ...
    def busy(self) -> int: ...
    def incompatible(self) -> int: ...
    def subscribe_logs(
        self, workflow_id: str | None = None, *, follow: bool = True
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]: ...


class RepairTools(Protocol):
    """What the control socket needs for the operator's tools (daemon.ops.repairs has them)."""

    async def graph(self, workflow: str, workflow_id: str | None, format: str) -> str: ...
    async def lint(self, workflow: str) -> Records: ...
    async def goto(
        self, workflow_id: str, thread_id: str, statement: str, *, who: int | None = None
    ) -> dict[str, Any]: ...
    async def edit(
        self, workflow_id: str, values: dict[str, Any], *, who: int | None = None
    ) -> dict[str, Any]: ...
    async def undo(self, workflow_id: str, *, who: int | None = None) -> dict[str, Any]: ...
    async def retry(self, workflow_id: str, *, who: int | None = None) -> dict[str, Any]: ...
    async def release(self, workflow_id: str) -> dict[str, Any]: ...
    async def release_all(self) -> dict[str, Any]: ...
    async def collect_garbage(self, keep_days: float | None = None) -> dict[str, Any]: ...


class DaemonOps(Protocol):
    """What the control socket needs from the daemon itself: reload and backup."""

    async def reload(self) -> dict[str, Any]: ...
    async def backup(self, path: str) -> dict[str, Any]: ...
    async def nodes(self) -> Records: ...
    def owner(self, status: str) -> str | None: ...
    def role(self) -> str: ...


class ScheduleTools(Protocol):
    """What the control socket needs for schedules (daemon.runtime.schedules has them)."""

    async def list(self) -> Records: ...
    async def show(self, name: str) -> dict[str, Any]: ...
    async def pause(self, name: str) -> dict[str, Any]: ...
    async def resume(self, name: str) -> dict[str, Any]: ...
    async def trigger(self, name: str) -> dict[str, Any]: ...


RepairRequest = (
    proto.Graph | proto.Lint | proto.Goto | proto.Edit | proto.Undo | proto.Retry
    | proto.Resume | proto.ResumeAll | proto.Gc
)  # fmt: skip


@functools.cache
def version() -> str:
    """Return the installed workflowd version."""
    try:
        return importlib.metadata.version("workflowd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class Dispatcher:
    """Runs requests against the runtime, the repair tools and the daemon's own ops."""

    def __init__(
        self,
        backend: Backend,
        *,
        repairs: RepairTools | None = None,
        ops: DaemonOps | None = None,
        schedules: ScheduleTools | None = None,
    ) -> None:
        self._backend, self._repairs, self._ops = backend, repairs, ops
        self._schedules = schedules

    async def __call__(self, req: proto.AnyRequest, reply: Reply, who: int | None = None) -> Any:
        """Run one request from the peer with uid `who`; return its result."""
        b = self._backend
        match req:
            case proto.Ping():
                return {
                    "version": version(),
                    "workflows": await b.counts(),
                    "busy": b.busy(),
                    "incompatible": b.incompatible(),
                    **(
                        {"nodes": await self._ops.nodes(), "role": self._ops.role()}
                        if self._ops is not None
                        else {}
                    ),
                }
            case proto.Start():
                return await b.start(req.workflow, req.workflow_id, req.input)
            case proto.Send():
                return await self._send(req)
            case proto.List():
                return await b.list(status=req.status, workflow=req.workflow, limit=req.limit)
            case proto.Show():
                shown = await b.show(req.workflow_id)
                if self._ops is not None:
                    shown["owner"] = self._ops.owner(str(shown.get("status")))
                return shown
            case proto.History():
                return await b.history(req.workflow_id, limit=req.limit)
            case proto.Cancel():
                return await b.cancel(req.workflow_id)
            case proto.Logs():
                return await self._logs(req, reply)
            case proto.Reload():
                return await self._daemon().reload()
            case proto.Backup():
                return await self._daemon().backup(req.path)
            case (
                proto.Graph() | proto.Lint() | proto.Goto() | proto.Edit() | proto.Undo()
                | proto.Retry() | proto.Resume() | proto.ResumeAll() | proto.Gc()
            ):  # fmt: skip
                return await self._repair(req, who)
            case (
                proto.Schedules() | proto.ScheduleShow() | proto.SchedulePause()
                | proto.ScheduleResume() | proto.ScheduleTrigger()
            ):  # fmt: skip
                return await self._schedule(req)
            case _:
                assert_never(req)

    async def _schedule(self, req: proto.ScheduleRequest) -> Any:
        s = self._schedules
        if s is None:
            raise Unavailable("this server does not offer schedules")
        match req:
            case proto.Schedules():
                return await s.list()
            case proto.ScheduleShow():
                return await s.show(req.name)
            case proto.SchedulePause():
                return await s.pause(req.name)
            case proto.ScheduleResume():
                return await s.resume(req.name)
            case proto.ScheduleTrigger():
                return await s.trigger(req.name)
            case _:
                assert_never(req)

    async def _repair(self, req: RepairRequest, who: int | None) -> Any:
        r = self._repairs
        if r is None:
            raise Unavailable("this server does not offer the repair tools")
        match req:
            case proto.Graph():
                return await r.graph(req.workflow, req.workflow_id, req.format)
            case proto.Lint():
                return await r.lint(req.workflow)
            case proto.Goto():
                return await r.goto(req.workflow_id, req.thread_id, req.statement, who=who)
            case proto.Edit():
                return await r.edit(req.workflow_id, req.set, who=who)
            case proto.Undo():
                return await r.undo(req.workflow_id, who=who)
            case proto.Retry():
                return await r.retry(req.workflow_id, who=who)
            case proto.Resume():
                return await r.release(req.workflow_id)
            case proto.ResumeAll():
                return await r.release_all()
            case proto.Gc():
                return await r.collect_garbage(req.keep_days)
            case _:
                assert_never(req)

    def _daemon(self) -> DaemonOps:
        if self._ops is None:
            raise Unavailable("this server does not offer reload or backup")
        return self._ops

    async def _send(self, req: proto.Send) -> Any:
        result = await self._backend.send(
            req.workflow_id, req.event, req.input, thread_id=req.thread_id, pc=req.pc, wait=req.wait
        )
        return result if req.wait else {"queued": True}

    async def _logs(self, req: proto.Logs, reply: Reply) -> Any:
        async with self._backend.subscribe_logs(req.workflow_id, follow=req.follow) as records:
            async for record in records:
                await reply(proto.log_line(req.id, record))
        return {"end": True}
