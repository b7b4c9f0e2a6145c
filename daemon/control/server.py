"""The control socket's server: binds or inherits it, admits local clients, runs their sessions."""

from __future__ import annotations

import os
import socket
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import structlog

from daemon.control import protocol as proto
from daemon.control import sockfile
from daemon.control.dispatch import Backend, DaemonOps, Dispatcher, RepairTools, ScheduleTools
from daemon.control.protocol import encode, error
from daemon.control.session import Dispatch, InFlight, Limits, Session
from daemon.control.wire import Wire

log = structlog.get_logger()

#: How long an allowed client waits for a slot before it is refused `unavailable`.
ADMIT_WAIT_S = 1.0


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
    max_in_flight: int = 16,
    max_buffered_bytes: int = 4 << 20,
    repairs: RepairTools | None = None,
    ops: DaemonOps | None = None,
    schedules: ScheduleTools | None = None,
    task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control protocol until cancelled; remove the socket file we created on exit.

    Reports the `Server` as started, whose `configure` changes limits live.
    """
    server = Server(Dispatcher(backend, repairs=repairs, ops=ops, schedules=schedules))
    server.configure(
        allowed_uids=allowed_uids,
        allowed_groups=allowed_groups,
        max_request_bytes=max_request_bytes,
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        max_in_flight=max_in_flight,
        max_buffered_bytes=max_buffered_bytes,
    )
    created: os.stat_result | None = None
    if listener is None:
        if socket_path is None:
            raise ValueError("serve() needs a socket_path or a listener")
        listener, created = await sockfile.bind(Path(socket_path), socket_mode)
    try:
        async with listener:
            log.info("control_listening", socket=str(socket_path or "(inherited)"))
            task_status.started(server)
            await server.accept_loop(listener)
    finally:
        if created is not None and socket_path is not None:
            sockfile.unlink_if_same(Path(socket_path), created)


@dataclass
class Server:
    """Per-server state: the allow-list, the limits and the count of open connections."""

    dispatch: Dispatch
    uids: set[int] = field(default_factory=set)
    gids: set[int] = field(default_factory=set)
    max_conns: int = 256
    limits: Limits = field(default_factory=Limits)
    #: The admitted connections that have not been seen to hang up.
    live: set[Wire] = field(default_factory=set)
    _freed: anyio.Event = field(default_factory=anyio.Event)
    in_flight: InFlight = field(default_factory=InFlight)
    _accepting: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    def configure(
        self,
        *,
        allowed_uids: Collection[int],
        allowed_groups: Collection[int | str],
        max_request_bytes: int,
        max_connections: int,
        idle_timeout: float,
        max_in_flight: int = 16,
        max_buffered_bytes: int = 4 << 20,
    ) -> None:
        """Apply new allow-lists and limits (a reload); open connections get the new limits."""
        self.uids = {0, os.getuid(), *allowed_uids}
        self.gids = {sockfile.group_id(g) for g in allowed_groups}
        self.max_conns = max_connections
        self.limits.max_bytes, self.limits.idle = max_request_bytes, idle_timeout
        self.limits.max_in_flight, self.limits.max_buffered = max_in_flight, max_buffered_bytes

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
        await self.in_flight.quiet(grace_s)

    async def connection(self, sock: socket.socket) -> None:
        """Serve one client; nothing a client does may take the server down."""
        try:
            wire = await Wire.adopt(sock)
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

    async def _admit(self, sock: socket.socket, wire: Wire) -> None:
        # Who it is comes first: a refused peer never holds a slot, so a flood of them cannot
        # crowd allowed clients out.
        pid, uid, gid = sockfile.peer_credentials(sock)
        if not await self._allowed(uid, gid):
            log.warning("control_forbidden", uid=uid, gid=gid, pid=pid)
            await self._say(wire, error(None, "forbidden", f"uid {uid} may not use workflowd"))
            return
        if not await self._take_slot():
            await self._say(wire, error(None, "unavailable", "too many connections"))
            return
        self.live.add(wire)
        try:
            session = Session(
                wire, uid, dispatch=self.dispatch, limits=self.limits, in_flight=self.in_flight
            )
            await session.run()
        finally:
            self.live.discard(wire)
            self._freed.set()

    @property
    def active(self) -> int:
        """Return how many admitted clients count against max_connections."""
        return len(self.live)

    async def _take_slot(self) -> bool:
        """Wait up to ADMIT_WAIT_S for fewer than max_connections live clients; False if not.

        Clients that already hung up do not count, though the loop may not have read their
        last bytes yet: a burst of short-lived clients leaves the slots of the gone ones free.
        """
        if len(self.live) >= self.max_conns:
            # Their sessions still answer what they sent before leaving (a `send` then a
            # close), but they no longer count.
            self.live.difference_update([w for w in self.live if w.hung_up()])
        with anyio.move_on_after(ADMIT_WAIT_S):
            while len(self.live) >= self.max_conns:
                self._freed = anyio.Event()
                await self._freed.wait()
        return len(self.live) < self.max_conns

    async def _allowed(self, uid: int, gid: int) -> bool:
        if uid in self.uids or gid in self.gids:
            return True
        if not self.gids:
            return False
        groups = await anyio.to_thread.run_sync(sockfile.peer_groups, uid, gid)
        return not self.gids.isdisjoint(groups)

    async def _say(self, wire: Wire, response: dict[str, Any]) -> None:
        if wire.write(encode(response)):
            with anyio.move_on_after(self.limits.idle):
                await wire.flushed()
