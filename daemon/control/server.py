"""The control socket's server: binds or inherits it, admits local clients, runs their sessions."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Collection
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
from daemon.control.session import Dispatch, InFlight, Limits, SendNow, Session
from daemon.control.wire import Wire
from daemon.control.wire import hung_up as wire_hung_up

log = structlog.get_logger()

#: How long an allowed client waits for a slot with none freed before it is refused
#: `unavailable`, and how long at most while slots are being freed.
ADMIT_WAIT_S, ADMIT_MAX_WAIT_S = 1.0, 30.0
#: How often, at most, a full server looks for clients that hung up or stalled.
SWEEP_S = 0.05
#: A client this long into sending one line, with nothing owed to it, may be evicted for a
#: new one when every slot is taken.
EVICT_STALLED_S = 1.0
#: Connections accepted but not yet admitted or refused, at most.
DECIDING = 64
#: A uid refused again within this many seconds is counted, not logged again.
FORBIDDEN_LOG_S = 1.0


async def serve(
    backend: Backend,
    *,
    socket_path: Path | None,
    listener: anyio.abc.SocketListener | None = None,
    socket_mode: int = 0o660,
    socket_group: int | None = None,
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
    dashboard: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Serve the control protocol until cancelled; remove the socket file we created on exit.

    Reports the `Server` as started, whose `configure` changes limits live.
    """
    dispatcher = Dispatcher(
        backend, repairs=repairs, ops=ops, schedules=schedules, dashboard=dashboard
    )
    server = Server(dispatcher, send_now=dispatcher.send_now)
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
        listener, created = await sockfile.bind(Path(socket_path), socket_mode, socket_group)
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
    #: Queues a waited-for `send` as it is read, with no task (None: every request dispatched).
    send_now: SendNow | None = None
    uids: set[int] = field(default_factory=set)
    gids: set[int] = field(default_factory=set)
    max_conns: int = 256
    limits: Limits = field(default_factory=Limits)
    #: The admitted connections that have not been seen to hang up, and their sessions.
    live: dict[Wire, Session] = field(default_factory=dict)
    _freed: anyio.Event = field(default_factory=anyio.Event)
    _swept_at: float = -1e9
    _waiting: int = 0
    #: Per refused uid: when it was last logged, and how many refusals since went unlogged.
    _refused: dict[int, tuple[float, int]] = field(default_factory=dict)
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
        # Connections not yet admitted or refused are few at a time: a flood of them (say,
        # a forbidden uid) waits in the kernel's backlog instead of filling the event loop's
        # ready queue, where every step of an allowed client's answer would queue behind it.
        deciding = anyio.Semaphore(DECIDING)
        async with anyio.create_task_group() as tg:
            with self._accepting:
                while True:
                    await deciding.acquire()
                    try:
                        sock = await sockfile.accept(listener)
                    except OSError as e:
                        deciding.release()
                        log.warning("control_accept_failed", error=str(e))
                        await anyio.sleep(0.1)  # EMFILE and the like: give clients time to leave
                        continue
                    except BaseException:
                        deciding.release()
                        raise
                    tg.start_soon(self.connection, sock, _Once(deciding.release))
            await anyio.sleep_forever()  # open connections finish their answers until cancelled

    async def wind_down(self, grace_s: float) -> None:
        """Stop accepting, then wait up to `grace_s` for the answers still being written."""
        self._accepting.cancel()
        await self.in_flight.quiet(grace_s)

    async def connection(self, sock: socket.socket, decided: Callable[[], None]) -> None:
        """Serve one client; nothing a client does may take the server down.

        `decided` is called once the client is admitted or refused (at the latest, at the end).
        """
        try:
            wire = await Wire.adopt(sock)
        except OSError:
            decided()
            sock.close()
            return
        try:
            await self._admit(sock, wire, decided)
        except ConnectionError:
            pass  # the peer went away
        except Exception:
            log.exception("control_connection_failed")
        finally:
            decided()
            wire.close()

    async def _admit(self, sock: socket.socket, wire: Wire, decided: Callable[[], None]) -> None:
        # Who it is comes first: a refused peer never holds a slot, so a flood of them cannot
        # crowd allowed clients out.
        pid, uid, gid = sockfile.peer_credentials(sock)
        if not await self._allowed(sock, uid, gid, pid):
            decided()
            self._log_forbidden(uid, gid, pid)
            await self._say(wire, error(None, "forbidden", f"uid {uid} may not use workflowd"))
            return
        session = Session(
            wire,
            uid,
            dispatch=self.dispatch,
            limits=self.limits,
            in_flight=self.in_flight,
            send_now=self.send_now,
        )
        if not await self._take_slot():
            decided()
            await self._say(wire, error(None, "unavailable", "too many connections"))
            return
        decided()
        self.live[wire] = session
        try:
            await session.run()
        finally:
            self.live.pop(wire, None)
            self._freed.set()

    @property
    def active(self) -> int:
        """Return how many admitted clients count against max_connections."""
        return len(self.live)

    async def _take_slot(self) -> bool:
        """Wait for fewer than max_connections live clients; False once none left for a while.

        While slots keep being freed (a burst of short clients, a cron of hundreds), a client
        waits its turn, up to ADMIT_MAX_WAIT_S; it is refused once no slot was freed for
        ADMIT_WAIT_S (every slot held by a client that stays).
        """
        now = anyio.current_time()
        deadline, last_chance = now + ADMIT_WAIT_S, now + ADMIT_MAX_WAIT_S
        self._waiting += 1
        try:
            while len(self.live) >= self.max_conns:
                self._make_room()
                if len(self.live) < self.max_conns:
                    break
                left = min(deadline, last_chance) - anyio.current_time()
                if left <= 0:
                    return False
                if self._freed.is_set():
                    self._freed = anyio.Event()
                with anyio.move_on_after(min(left, SWEEP_S)):
                    await self._freed.wait()
                    deadline = anyio.current_time() + ADMIT_WAIT_S  # the line moves
            return True
        finally:
            self._waiting -= 1

    def _make_room(self) -> None:
        """Uncount the clients that hung up; at the limit still, evict the stalest trickler.

        A hung-up client's session still answers what it sent before leaving (a `send`, then
        a close), but no longer counts, though the loop may not have read its last bytes yet.
        A client that has been sending one line for EVICT_STALLED_S with no answer owed is
        holding a slot, not using it: the longest such one makes way for a new client.
        """
        now = anyio.current_time()
        if now - self._swept_at < SWEEP_S:
            return
        self._swept_at = now
        for gone in wire_hung_up(self.live):
            del self.live[gone]
        room = self._waiting - (self.max_conns - len(self.live))
        if room <= 0:
            return
        stalled = sorted(((s.stalled_for(), w) for w, s in self.live.items()), key=_first)
        for for_s, wire in stalled[-room:]:
            if for_s >= EVICT_STALLED_S:
                log.warning("control_client_evicted", uid=self.live[wire].uid, stalled_s=for_s)
                del self.live[wire]
                wire.abort()

    def _log_forbidden(self, uid: int, gid: int, pid: int) -> None:
        """Log a refused peer; a flood from one uid logs once a second, with its count."""
        now = anyio.current_time()
        last, quiet = self._refused.get(uid, (-1e9, 0))
        if now - last < FORBIDDEN_LOG_S:
            self._refused[uid] = (last, quiet + 1)
            return
        if len(self._refused) > 1024:
            self._refused.clear()  # many uids refused: forget, at worst log them again
        self._refused[uid] = (now, 0)
        log.warning("control_forbidden", uid=uid, gid=gid, pid=pid, unlogged_since=quiet)

    async def _allowed(self, sock: socket.socket, uid: int, gid: int, pid: int) -> bool:
        if uid in self.uids or gid in self.gids:
            return True
        if not self.gids:
            return False
        groups = sockfile.peer_groups(sock, pid, uid, gid)  # a syscall, or one small /proc file
        return not self.gids.isdisjoint(groups)

    async def _say(self, wire: Wire, response: dict[str, Any]) -> None:
        if wire.write(encode(response)):
            with anyio.move_on_after(self.limits.idle):
                await wire.flushed()


def _first(pair: tuple[float, Wire]) -> float:
    return pair[0]


class _Once:
    """Calls a function the first time it is called, and never again."""

    def __init__(self, function: Callable[[], None]) -> None:
        self._function: Callable[[], None] | None = function

    def __call__(self) -> None:
        function, self._function = self._function, None
        if function is not None:
            function()
