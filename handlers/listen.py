"""SocketListen: a Wait case fired by one message on a Unix or TCP socket; the sender gets the reply.

The listener exists only while `listen` runs; OneShot serves its clients.
A Unix socket file gets mode 0o660. A stale socket of the daemon's own uid is replaced; a live
one, another uid's, or a file that is no socket is never touched (the path may be a client's).
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import stat
from typing import Any

import anyio
import msgspec
from anyio.abc import Listener, SocketListener, SocketStream

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
    path = addr.path
    _check_ours(path)  # not a socket, or another uid's: refused at once, live or not
    # Never steal a live socket, but give the previous wait on this path a moment to finish
    # answering its client.
    live = True
    with anyio.move_on_after(HANDOVER_S):
        while live := await _is_live(path):  # noqa: ASYNC110 - a socket has no event to wait on
            await anyio.sleep(0.02)
    if live:
        raise OSError(errno.EADDRINUSE, "another process listens on this socket", path)
    stale = _check_ours(path)
    if stale is not None:
        _unlink(path, stale)
    # Bound here rather than by anyio's create_unix_listener, which first removes whatever
    # socket it finds at the path, whoever owns it; bind() itself never replaces a file.
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            raw.bind(path)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise FileExistsError(
                errno.EEXIST, "a file appeared at the socket path; left alone", path
            ) from None
        inode = os.lstat(path).st_ino
        os.chmod(path, 0o660)
        raw.listen(128)
        raw.setblocking(False)
        return await SocketListener.from_socket(raw), inode
    except BaseException:
        raw.close()
        raise


def _check_ours(path: str) -> int | None:
    """Return the inode of the socket of our uid at `path` (None if nothing is there).

    Raise FileExistsError, leaving the file alone, if it is anything else: a regular file, a
    link, or a socket of another uid. The path comes from workflow code and may be a client's
    choice, so the listener takes over no file it did not make.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            errno.EEXIST, "a file that is not a socket is at the socket path; left alone", path
        )
    if st.st_uid != os.geteuid():
        raise FileExistsError(
            errno.EEXIST,
            f"a socket of uid {st.st_uid} is at the path (ours is {os.geteuid()}); left alone",
            path,
        )
    return st.st_ino


def _unlink(path: str, inode: int | None) -> None:
    """Remove the socket file of our uid at `path` (only if it still has `inode`, when given)."""
    try:
        st = os.lstat(path)
        ours = stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()
        if ours and inode in (None, st.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass
