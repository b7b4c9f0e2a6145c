"""SocketListen: a Wait case fired by one message on a Unix or TCP socket; the sender gets the reply.

The listener exists only while `listen` runs; OneShot serves its clients.
A Unix socket file gets mode 0o660; a stale one is replaced, a live one never.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from typing import Any

import anyio
import msgspec
from anyio.abc import Listener, SocketStream

from daemon.core.handler import CallbackRequest, Deliver

from ._oneshot import OneShot

HANDOVER_S = 1.0
_MAX_UNIX_PATH = 108


class _Address(msgspec.Struct, omit_defaults=True):
    path: str | None = None
    host: str | None = None
    port: int | None = None


class SocketListen:
    """Fires when a client sends one line to the Unix socket `path` or to TCP `host:port`."""

    type = "socket"

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        timeout: float = 10.0,
    ) -> None:
        if (path is None) == (port is None):
            raise ValueError("SocketListen needs exactly one of path= or port=")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"SocketListen(port=) must be in 1..65535, not {port!r}")
        if not timeout > 0:
            raise ValueError(f"SocketListen(timeout=) must be > 0, not {timeout!r}")
        self.path = None if path is None else os.fspath(path)
        self.port, self.host, self.timeout = port, host, timeout

    async def setup(self, req: CallbackRequest) -> str:
        """Check the address and store it (a Unix path made absolute)."""
        if self.path is None:
            return msgspec.json.encode(_Address(host=self.host, port=self.port)).decode()
        # No liveness check here: the previous wait on this path may still be answering.
        return msgspec.json.encode(_Address(path=_check_path(self.path))).decode()

    async def listen(self, req: CallbackRequest, deliver: Deliver) -> None:
        """Serve clients until one message is delivered and answered, then close the listener."""
        addr = msgspec.json.decode(req.setup_data, type=_Address)
        listener, inode = await _bind(addr)
        release = None if addr.path is None else functools.partial(_unlink, addr.path, inode)
        shot = OneShot(deliver, self.timeout, release)
        async with listener:
            try:
                await shot.serve(listener)
            finally:
                shot.release()  # while still listening: until then nobody else may bind the path

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Return the input; it is also the client's reply."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Remove a socket file left behind (listen never ran or died), unless it is live."""
        addr = msgspec.json.decode(req.setup_data or "{}", type=_Address)
        if addr.path is not None and not await _is_live(addr.path):
            _unlink(addr.path, None)


def _check_path(path: str) -> str:
    """Return the absolute socket path after checking it can be bound."""
    path = os.path.abspath(path)
    if len(os.fsencode(path)) >= _MAX_UNIX_PATH:
        raise ValueError(f"socket path is {len(os.fsencode(path))} bytes, the limit is 107: {path}")
    if not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(errno.ENOENT, "socket directory does not exist", path)
    return path


async def _is_live(path: str) -> bool:
    """Tell whether a process accepts connections on the Unix socket at `path`."""
    try:
        with anyio.fail_after(1):
            stream = await anyio.connect_unix(path)
    except TimeoutError:
        return True  # its backlog is full: it is alive, only busy
    except OSError:
        return False
    await stream.aclose()
    return True


async def _bind(addr: _Address) -> tuple[Listener[SocketStream], int | None]:
    """Bind the listener; for a Unix socket, also return the inode of its file."""
    if addr.path is None:
        # anyio sets SO_REUSEADDR, so a restart rebinds at once.
        tcp = await anyio.create_tcp_listener(local_host=addr.host, local_port=addr.port or 0)
        return tcp, None
    # anyio removes any socket file it finds: never steal a live one, but give the
    # previous wait on this path a moment to finish answering its client.
    live = True
    with anyio.move_on_after(HANDOVER_S):
        while live := await _is_live(addr.path):  # noqa: ASYNC110 - a socket has no event to wait on
            await anyio.sleep(0.02)
    if live:
        raise OSError(errno.EADDRINUSE, "another process listens on this socket", addr.path)
    # anyio binds in a worker thread it abandons on cancel, leaving the socket file
    # behind: let the (quick) bind finish, so listen's cleanup removes the file.
    with anyio.CancelScope(shield=True):
        unix = await anyio.create_unix_listener(addr.path)
        try:
            os.chmod(addr.path, 0o660)
            return unix, os.stat(addr.path).st_ino
        except FileNotFoundError:
            await unix.aclose()
    # The wait was torn down while binding and its teardown removed the file: end quietly.
    await anyio.lowlevel.checkpoint_if_cancelled()
    raise FileNotFoundError(errno.ENOENT, "socket file removed while binding", addr.path)


def _unlink(path: str, inode: int | None) -> None:
    """Remove the socket file at `path` (only if it is still the one with `inode`, when given)."""
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and inode in (None, st.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass
