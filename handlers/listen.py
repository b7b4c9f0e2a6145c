"""SocketListen: a Wait case fired by one message on a Unix or TCP socket; the sender gets the reply.

The listener exists only while `listen` runs. Clients are served concurrently;
the first one that sends a line (at most 1 MiB) hands it to the workflow: the
line parsed as JSON, or the raw text if it is not JSON. It gets back one JSON
line, `{"ok": true, "result": ...}`, and the listener closes. If the workflow
rejects the input, the client gets `{"ok": false, "error": {"code", "message"}}`
and the listener stays open for the next one. A client that sends nothing for
`timeout` seconds is dropped without holding up the others.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

import anyio
import msgspec
from anyio.abc import Listener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from daemon.errors import BadRequest, StaleCallback, WorkflowError
from daemon.handler import CallbackRequest, Deliver

MAX_LINE = 1 << 20
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
        session = _Session(deliver, self.timeout, addr.path, inode)
        async with listener:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(listener.serve, session.client, tg)
                    await session.done.wait()
                    tg.cancel_scope.cancel()
            finally:
                session.release()
        if session.failure is not None:
            raise session.failure

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Return the input; it is also the client's reply."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Remove a socket file left behind (listen never ran or died), unless it is live."""
        addr = msgspec.json.decode(req.setup_data or "{}", type=_Address)
        if addr.path is not None and not await _is_live(addr.path):
            _unlink(addr.path, None)


class _Session:
    """One run of `listen`: serves its clients, one delivery at a time, until one succeeds."""

    def __init__(self, deliver: Deliver, timeout: float, path: str | None, inode: int | None):
        self.deliver, self.timeout, self.path, self.inode = deliver, timeout, path, inode
        self.turn = anyio.Lock()
        self.fired = False
        self.done = anyio.Event()
        self.failure: Exception | None = None

    def release(self) -> None:
        """Remove our socket file, once: no new client can reach this listener after that."""
        if self.path is not None:
            _unlink(self.path, self.inode)
            self.path = None

    async def client(self, stream: SocketStream) -> None:
        """Serve one client; its errors never stop the listener."""
        async with stream:
            try:
                await self._serve(stream)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # the client went away; the wait stays open
            except Exception as e:  # noqa: BLE001 - listen re-raises it
                self.failure = e
                self.done.set()

    async def _serve(self, stream: SocketStream) -> None:
        """Read one line from a client, deliver it and answer."""
        reader = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.timeout):
                line = await reader.receive_until(b"\n", MAX_LINE)
        except anyio.IncompleteRead:
            line = reader.buffer  # the client closed its side after a message without "\n"
            if not line:
                return
        except anyio.DelimiterNotFound:
            return await self._reply(stream, _error(BadRequest(f"message over {MAX_LINE} bytes")))
        except TimeoutError:
            error = {"code": "timeout", "message": f"no message within {self.timeout} s"}
            return await self._reply(stream, {"ok": False, "error": error})
        async with self.turn:  # only the first successful delivery fires the wait
            if self.fired:
                return await self._reply(stream, _error(StaleCallback("the wait has fired")))
            try:
                out = await self.deliver(_parse(line))
            except WorkflowError as e:
                return await self._reply(stream, _error(e))
            except Exception:
                await self._reply(stream, _error(WorkflowError()))
                raise
            self.fired = True
            self.release()  # the next wait may bind this path while we answer
            try:
                await self._reply(stream, {"ok": True, "result": out})
            finally:
                self.done.set()

    async def _reply(self, stream: SocketStream, message: dict[str, Any]) -> None:
        """Send one JSON line, giving up after the timeout on a client that does not read."""
        try:
            data = msgspec.json.encode(message)
        except (TypeError, msgspec.EncodeError) as e:
            data = msgspec.json.encode(_error(WorkflowError(f"reply is not JSON: {e}")))
        with anyio.move_on_after(self.timeout):
            await stream.send(data + b"\n")


def _error(e: WorkflowError) -> dict[str, Any]:
    return {"ok": False, "error": {"code": e.code, "message": str(e)}}


def _parse(line: bytes) -> Any:
    """Return the line as JSON, or as text when it is not JSON."""
    line = line.removesuffix(b"\r")
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        return line.decode("utf-8", "replace")


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
    unix = await anyio.create_unix_listener(addr.path, mode=0o660)
    return unix, os.stat(addr.path).st_ino


def _unlink(path: str, inode: int | None) -> None:
    """Remove the socket file at `path` (only if it is still the one with `inode`, when given)."""
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and inode in (None, st.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass
