"""The control socket: accepts local clients, checks who they are and dispatches their requests."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, assert_never, runtime_checkable

import anyio
import anyio.abc
import structlog

from daemon.control import protocol as proto
from daemon.control import sockfile
from daemon.control.protocol import encode, error
from daemon.control.session import Session
from daemon.errors import Unavailable

log = structlog.get_logger()

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
    def subscribe_logs(
        self, workflow_id: str | None = None, *, follow: bool = True
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]: ...


class DaemonOps(Protocol):
    """What the control socket needs from the daemon itself: reload and backup."""

    async def reload(self) -> dict[str, Any]: ...
    async def backup(self, path: str) -> dict[str, Any]: ...


@runtime_checkable
class Repairs(Protocol):
    """What the control socket needs for the operator's tools (the runtime has them)."""

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


async def serve(
    backend: Backend,
    *,
    socket_path: Path | None,
    listener: anyio.abc.SocketListener | None = None,
    socket_mode: int = 0o660,
    allowed_uids: Collection[int] = (),
    allowed_groups: Collection[int | str] = (),
    max_request_bytes: int = proto.MAX_REQUEST_BYTES,
    max_connections: int = 256,
    idle_timeout: float = 300.0,
    ops: DaemonOps | None = None,
    task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control protocol until cancelled; remove the socket file we created on exit.

    Reports the server's state object as started, whose `configure` changes limits live.
    """
    uids = {0, os.getuid(), *allowed_uids}
    gids = {sockfile.group_id(g) for g in allowed_groups}
    control = _Control(backend, uids, gids, max_request_bytes, max_connections, idle_timeout)
    control.ops = ops
    created: os.stat_result | None = None
    if listener is None:
        if socket_path is None:
            raise ValueError("serve() needs a socket_path or a listener")
        listener, created = await sockfile.bind(Path(socket_path), socket_mode)
    try:
        async with listener:
            log.info("control_listening", socket=str(socket_path or "(inherited)"))
            task_status.started(control)
            await control.accept_loop(listener)
    finally:
        if created is not None and socket_path is not None:
            sockfile.unlink_if_same(Path(socket_path), created)


@dataclass
class _Control:
    """Per-server state: limits, the allow-list and the count of open connections."""

    backend: Backend
    uids: set[int]
    gids: set[int]
    max_bytes: int
    max_conns: int
    idle: float
    active: int = 0
    ops: DaemonOps | None = None
    #: Requests being answered across every connection.
    in_flight: int = 0
    _accepting: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    _quiet: anyio.Event = field(default_factory=anyio.Event)

    def configure(
        self,
        *,
        allowed_uids: Collection[int],
        allowed_groups: Collection[int | str],
        max_request_bytes: int,
        max_connections: int,
        idle_timeout: float,
    ) -> None:
        """Apply new allow-lists and limits (a reload); open connections keep their session."""
        self.uids = {0, os.getuid(), *allowed_uids}
        self.gids = {sockfile.group_id(g) for g in allowed_groups}
        self.max_bytes, self.max_conns, self.idle = max_request_bytes, max_connections, idle_timeout

    async def accept_loop(self, listener: anyio.abc.SocketListener) -> None:
        """Accept clients until `wind_down`; running out of file descriptors must not stop it."""
        async with anyio.create_task_group() as tg:
            with self._accepting:
                while True:
                    try:
                        sock = await sockfile.accept(listener)
                    except OSError as e:
                        log.warning("control_accept_failed", error=str(e))
                        await anyio.sleep(0.1)  # EMFILE and the like: give clients time to leave
                        continue
                    tg.start_soon(self.connection, sock)
            await anyio.sleep_forever()  # open connections finish their answers until cancelled

    async def wind_down(self, grace_s: float) -> None:
        """Stop accepting, then wait up to `grace_s` for the answers still being written."""
        self._accepting.cancel()
        with anyio.move_on_after(grace_s):
            while self.in_flight:
                self._quiet = anyio.Event()
                await self._quiet.wait()

    def request_started(self) -> None:
        """Count a request being answered."""
        self.in_flight += 1

    def request_done(self) -> None:
        """Count a request answered."""
        self.in_flight -= 1
        if not self.in_flight:
            self._quiet.set()

    async def connection(self, sock: socket.socket) -> None:
        """Serve one client; nothing a client does may take the server down."""
        try:
            wire = await sockfile.Wire.adopt(sock)
        except OSError:
            sock.close()
            return
        try:
            await self._admit(sock, wire)
        except ConnectionError:
            pass  # the peer went away
        except Exception:
            log.exception("control_connection_failed")
        finally:
            wire.close()

    async def _admit(self, sock: socket.socket, wire: sockfile.Wire) -> None:
        if self.active >= self.max_conns:
            await self._say(wire, error(None, "unavailable", "too many connections"))
            return
        self.active += 1
        try:
            pid, uid, gid = sockfile.peer_credentials(sock)
            if not await self._allowed(uid, gid):
                log.warning("control_forbidden", uid=uid, gid=gid, pid=pid)
                await self._say(wire, error(None, "forbidden", f"uid {uid} may not use workflowd"))
                return
            await Session(self, wire, uid).run()
        finally:
            self.active -= 1

    async def _allowed(self, uid: int, gid: int) -> bool:
        if uid in self.uids or gid in self.gids:
            return True
        if not self.gids:
            return False
        groups = await anyio.to_thread.run_sync(sockfile.peer_groups, uid, gid)
        return not self.gids.isdisjoint(groups)

    async def _say(self, wire: sockfile.Wire, response: dict[str, Any]) -> None:
        if wire.write(encode(response)):
            with anyio.move_on_after(self.idle):
                await wire.flushed()

    async def dispatch(self, req: proto.AnyRequest, reply: Reply, who: int | None = None) -> Any:
        """Run one request from the peer with uid `who` against the backend; return its result."""
        b = self.backend
        match req:
            case proto.Ping():
                return {"version": version(), "workflows": await b.counts(), "busy": b.busy()}
            case proto.Start():
                return await b.start(req.workflow, req.workflow_id, req.input)
            case proto.Send():
                return await self._send(req)
            case proto.List():
                return await b.list(status=req.status, workflow=req.workflow, limit=req.limit)
            case proto.Show():
                return await b.show(req.workflow_id)
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
            case _:
                assert_never(req)

    async def _repair(self, req: RepairRequest, who: int | None) -> Any:
        b = self.backend
        if not isinstance(b, Repairs):
            raise Unavailable("this server does not offer the repair tools")
        match req:
            case proto.Graph():
                return await b.graph(req.workflow, req.workflow_id, req.format)
            case proto.Lint():
                return await b.lint(req.workflow)
            case proto.Goto():
                return await b.goto(req.workflow_id, req.thread_id, req.statement, who=who)
            case proto.Edit():
                return await b.edit(req.workflow_id, req.set, who=who)
            case proto.Undo():
                return await b.undo(req.workflow_id, who=who)
            case proto.Retry():
                return await b.retry(req.workflow_id, who=who)
            case proto.Resume():
                return await b.release(req.workflow_id)
            case proto.ResumeAll():
                return await b.release_all()
            case proto.Gc():
                return await b.collect_garbage(req.keep_days)
            case _:
                assert_never(req)

    def _daemon(self) -> DaemonOps:
        if self.ops is None:
            raise Unavailable("this server does not offer reload or backup")
        return self.ops

    async def _send(self, req: proto.Send) -> Any:
        result = await self.backend.send(
            req.workflow_id, req.event, req.input, thread_id=req.thread_id, pc=req.pc, wait=req.wait
        )
        return result if req.wait else {"queued": True}

    async def _logs(self, req: proto.Logs, reply: Reply) -> Any:
        async with self.backend.subscribe_logs(req.workflow_id, follow=req.follow) as records:
            async for record in records:
                await reply(proto.log_line(req.id, record))
        return {"end": True}
