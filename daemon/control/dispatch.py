"""From a decoded request to its result: one `match` over the ops, one line per verb."""

from __future__ import annotations

import base64
import functools
import importlib.metadata
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any, Protocol, assert_never

import anyio
import msgspec

from daemon.control import protocol as proto
from daemon.errors import BadRequest, Unavailable

#: Writes one extra response line (a streamed log record) before the final answer.
Reply = Callable[[dict[str, Any]], Awaitable[None]]
Records = list[dict[str, Any]]  # `list` is shadowed inside Backend
Ids = list[str]
#: Where a listing stopped: the last row's (updated_at, rowid) for the daemon's store.
Position = tuple[float, int]


class Backend(Protocol):
    """What the control socket needs from the runtime."""

    async def start(
        self,
        workflow: str,
        workflow_id: str | None = None,
        input: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
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
    def send_now(
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
    ) -> Pending | None: ...
    async def list(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        parent: str | None = None,
    ) -> Records: ...
    async def page(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        after: Position | None = None,
        parent: str | None = None,
    ) -> tuple[Records, Position | None]: ...
    async def show(self, workflow_id: str) -> dict[str, Any]: ...
    async def history(self, workflow_id: str, *, limit: int = 1000) -> Records: ...
    async def cancel(self, workflow_id: str) -> dict[str, Any]: ...
    async def counts(self) -> dict[str, int]: ...
    def busy(self) -> int: ...
    def incompatible(self) -> int: ...
    def subscribe_logs(
        self, workflow_id: str | None = None, *, follow: bool = True
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]: ...
    async def wait(
        self,
        workflow_ids: Ids,
        *,
        any: bool = False,
        timeout_s: float | None = None,
        until: str = "ended",
    ) -> dict[str, Any]: ...
    def types(self) -> Records: ...


class Pending(Protocol):
    """An answer still to come (the runtime's `Reply`)."""

    def then(self, callback: Callable[[], None]) -> None: ...
    def result(self) -> Any: ...


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
    async def backup(self, name: str) -> dict[str, Any]: ...
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
        dashboard: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._backend, self._repairs, self._ops = backend, repairs, ops
        self._schedules = schedules
        self._dashboard = dashboard
        #: Pages of `list` summarized at once, across every connection: the others wait off
        #: the event loop's ready queue, so a flood of lists leaves a ping a short turn.
        self._listing = anyio.Semaphore(LISTS_AT_ONCE)

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
                return await b.start(
                    req.workflow, req.workflow_id, req.input, timeout_s=req.timeout_s
                )
            case proto.Send():
                return await self._send(req)
            case proto.List():
                return await self._list(req)
            case proto.Show():
                shown = await b.show(req.workflow_id)
                if self._ops is not None and "owner" not in shown:  # shared: the row's owner
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
                return await self._daemon().backup(req.name)
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
            case proto.Dashboard():
                if self._dashboard is None:
                    raise Unavailable("this server does not offer a dashboard")
                return self._dashboard()
            case proto.Wait():
                return await b.wait(
                    req.workflow_ids, any=req.any, timeout_s=req.timeout_s, until=req.until
                )
            case proto.Types():
                return b.types()
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

    async def _list(self, req: proto.List) -> proto.Page:
        status, workflow, parent, after = req.status, req.workflow, req.parent, None
        if req.cursor is not None:
            status, workflow, parent, after = _listing_of(req)
        async with self._listing:
            rows, position = await self._backend.page(
                status=status, workflow=workflow, limit=req.limit, after=after, parent=parent
            )
        cursor = None if position is None else _cursor(status, workflow, parent, position)
        return proto.Page(rows, cursor)

    def send_now(self, req: proto.Send) -> Pending | None:
        """Queue a waited-for `send` without awaiting; None if it must go through `__call__`."""
        if not req.wait:
            return None
        return self._backend.send_now(
            req.workflow_id, req.event, req.input, thread_id=req.thread_id, pc=req.pc
        )

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


#: How many `list` requests are answered at once; the rest wait their turn.
LISTS_AT_ONCE = 2
_CURSOR_PREFIX = "c1."
_RowId = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # what SQLite can bind
_Listing = tuple[float, _RowId, str | None, str | None, str | None]


def _cursor(
    status: str | None, workflow: str | None, parent: str | None, position: Position
) -> str:
    """Return the opaque cursor of a listing's next page: its filters and where it stopped."""
    listing: _Listing = (*position, status, workflow, parent)
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(msgspec.json.encode(listing)).decode()


def _listing_of(req: proto.List) -> tuple[str | None, str | None, str | None, Position]:
    """Return the filters and position of `req.cursor`; BadRequest if it is not one of ours."""
    text = req.cursor or ""
    try:
        if not text.startswith(_CURSOR_PREFIX):
            raise ValueError(text)
        raw = base64.urlsafe_b64decode(text[len(_CURSOR_PREFIX) :].encode())
        at, rowid, status, workflow, parent = msgspec.json.decode(raw, type=_Listing)
    except (ValueError, msgspec.MsgspecError):
        raise BadRequest("`cursor` is not a cursor a `list` answered") from None
    for field, given, kept in (
        ("status", req.status, status),
        ("workflow", req.workflow, workflow),
        ("parent", req.parent, parent),
    ):
        if given is not None and given != kept:
            raise BadRequest(f"`{field}` differs from the listing the cursor belongs to")
    return status, workflow, parent, (at, rowid)
