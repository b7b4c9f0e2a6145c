"""The control socket: accepts local clients, checks who they are and dispatches their requests."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import os
import socket
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, assert_never, runtime_checkable

import anyio
import anyio.abc
import msgspec
import structlog

from . import protocol as proto
from . import sockfile
from .errors import Unavailable, WorkflowError
from .protocol import encode, error

log = structlog.get_logger()

#: Requests one connection may have in flight; the reader waits (backpressure) beyond that.
MAX_IN_FLIGHT = 64

#: Decodes a valid request in one pass; anything it refuses goes through decode_request,
#: whose errors explain what is wrong (converting a decoded dict costs ~20 µs a request).
_requests = msgspec.json.Decoder(proto.AnyRequest)

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
            await _Session(self, wire, uid).run()
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
                return {"version": version(), "workflows": await b.counts()}
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


Parked = asyncio.Future["proto.AnyRequest | proto.ProtocolError | None"]


class _Session:
    """One connection: reads request lines and answers each in a task of its own.

    A task that has answered waits for the next request instead of ending: handing a request
    to it costs a fraction of starting a task, and a client waiting for each answer before it
    sends again is served by the same task throughout.
    """

    def __init__(self, control: _Control, wire: sockfile.Wire, uid: int | None = None) -> None:
        self.control, self.wire, self.uid = control, wire, uid
        self.in_flight = 0
        self.eof = False
        self.parked: list[Parked] = []
        self.closing = False
        self.room: anyio.Event | None = None

    async def run(self) -> None:
        """Answer every request until EOF, idleness or an oversized line."""
        async with anyio.create_task_group() as self.tg, anyio.create_task_group() as follows:
            while not self.eof and (line := await self._next_line()) is not None:
                if len(line) > self.control.max_bytes:
                    message = f"request line over {self.control.max_bytes} bytes"
                    await self.reply(error(None, "too_large", message))
                    self.tg.cancel_scope.cancel()
                    return
                if line.strip():
                    req = _decode(line)
                    while self.in_flight >= MAX_IN_FLIGHT:
                        self.room = anyio.Event()
                        await self.room.wait()
                    self.in_flight += 1
                    self.control.request_started()
                    if isinstance(req, proto.Logs) and req.follow:
                        follows.start_soon(self._answer, req)
                    else:
                        self._hand_over(req)
            follows.cancel_scope.cancel()  # the client stopped talking: stop streaming logs to it
            self.closing = True
            while self.parked:
                self._hand_over(None)

    def _hand_over(self, req: proto.AnyRequest | proto.ProtocolError | None) -> None:
        while self.parked:
            parked = self.parked.pop()
            if not parked.done():
                parked.set_result(req)
                return
        if req is not None:
            self.tg.start_soon(self._answerer, req)

    async def _answerer(self, req: proto.AnyRequest | proto.ProtocolError | None) -> None:
        loop = asyncio.get_running_loop()
        while req is not None:
            await self._answer(req)
            if self.closing:
                return
            parked: Parked = loop.create_future()
            self.parked.append(parked)
            req = await parked

    async def _next_line(self) -> bytes | None:
        """Return the next line (too long if over the limit), or None once idle or gone."""
        wire = self.wire
        while True:
            line = wire.line(self.control.max_bytes)
            if line is not None:
                return line
            if wire.eof:
                self.eof = True
                return wire.rest()  # a last request may lack its newline
            if wire.lost:
                self.tg.cancel_scope.cancel()  # the peer is gone: nobody to answer
                return None
            if not await wire.readable(self.control.idle) and not self.in_flight:
                return None

    async def _answer(self, req: proto.AnyRequest | proto.ProtocolError) -> None:
        try:
            if isinstance(req, proto.ProtocolError):
                await self.reply(error(req.id, req.code, req.message))
            else:
                await self.reply(await self._respond(req))
        finally:
            self.in_flight -= 1
            self.control.request_done()
            if self.room is not None:
                self.room.set()

    async def _respond(self, req: proto.AnyRequest) -> dict[str, Any]:
        try:
            return proto.ok(req.id, await self.control.dispatch(req, self.reply, self.uid))
        except WorkflowError as e:
            return error(req.id, e.code, e.message)
        except (sqlite3.Error, OSError) as e:
            # Disk full, database locked: nothing was acknowledged, the client may retry.
            log.error("control_storage_error", error=f"{type(e).__name__}: {e}")
            return error(req.id, "unavailable", f"storage error: {type(e).__name__}: {e}")
        except Exception as e:
            log.exception("control_request_failed", op=type(req).__name__.lower())
            return error(req.id, "internal", f"{type(e).__name__}: {e}")

    async def reply(self, response: dict[str, Any]) -> None:
        """Write one response line; a peer that stops reading or goes away is dropped."""
        try:
            data = encode(response)
        except Exception:
            log.exception("control_encode_failed")
            message = "the result cannot be encoded as JSON"
            data = encode(error(response.get("id"), "internal", message))
        wire = self.wire
        if not wire.write(data):
            self.tg.cancel_scope.cancel()
            return
        if wire.lost:
            self.tg.cancel_scope.cancel()
        elif not wire.is_flushed():
            with anyio.move_on_after(self.control.idle) as stalled:
                await wire.flushed()
            if stalled.cancelled_caught or wire.lost:
                self.tg.cancel_scope.cancel()


def _decode(line: bytes) -> proto.AnyRequest | proto.ProtocolError:
    try:
        request: proto.AnyRequest = _requests.decode(line)
        return request
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        return proto.decode_request(line)
    except proto.ProtocolError as e:
        return e
