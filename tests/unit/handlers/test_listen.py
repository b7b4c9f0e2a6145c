"""SocketListen driven directly: setup, listen with a real deliver, teardown; real sockets."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from daemon.core.handler import ActiveHandler, CallbackRequest
from daemon.errors import HandlerRejected
from handlers import SocketListen
from handlers._oneshot import MAX_LINE


class Inbox:
    """A deliver coroutine that records inputs; it rejects the first `reject` of them."""

    def __init__(self, reject: int = 0) -> None:
        self.inputs: list[Any] = []
        self.reject = reject

    async def __call__(self, input: Any) -> Any:
        self.inputs.append(input)
        if len(self.inputs) <= self.reject:
            raise HandlerRejected("no thanks")
        return {"echo": input}


async def connect(where: Path | int) -> SocketStream:
    """Connect to the listener, retrying until it is bound (with a ceiling)."""
    with anyio.fail_after(10):
        while True:
            try:
                if isinstance(where, int):
                    return await anyio.connect_tcp("127.0.0.1", where)
                return await anyio.connect_unix(where)
            except OSError:
                await anyio.sleep(0.01)


async def ask(where: Path | int, data: bytes) -> Any:
    """Send `data` as one client and return the parsed reply line (None if closed without one)."""
    async with await connect(where) as stream:
        await stream.send(data)
        return await read_reply(stream)


async def read_reply(stream: SocketStream) -> Any:
    """Read one reply line from the listener."""
    with anyio.fail_after(10):
        try:
            line = await BufferedByteReceiveStream(stream).receive_until(b"\n", 1 << 16)
        except anyio.IncompleteRead:
            return None
    return json.loads(line)


async def setup(handler: SocketListen) -> CallbackRequest:
    """Run setup and return a request carrying its setup data."""
    req = CallbackRequest("wf", "main", "case", 1)
    req.setup_data = await handler.setup(req)
    return req


def free_port() -> int:
    """Return a TCP port that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class TestConstruction:
    def test_is_active_handler(self) -> None:
        """SocketListen satisfies the ActiveHandler protocol."""
        assert isinstance(SocketListen(port=1234), ActiveHandler)
        assert SocketListen(port=1234).type == "socket"

    def test_exactly_one_address(self) -> None:
        """Exactly one of path and port is required."""
        with pytest.raises(ValueError, match="exactly one"):
            SocketListen()
        with pytest.raises(ValueError, match="exactly one"):
            SocketListen(path="/tmp/s", port=1)

    async def test_setup_checks_the_path(self, tmp_path: Path) -> None:
        """Setup refuses a path over the Unix limit and a missing directory."""
        with pytest.raises(ValueError, match="limit"):
            await setup(SocketListen(path=tmp_path / ("x" * 120)))
        with pytest.raises(FileNotFoundError):
            await setup(SocketListen(path=tmp_path / "missing" / "s"))


class TestFire:
    async def test_json_message(self, tmp_path: Path) -> None:
        """A JSON line is delivered parsed; the client gets the result and listen cleans up."""
        path = tmp_path / "s"
        handler, inbox = SocketListen(path=path), Inbox()
        req = await setup(handler)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                reply = await ask(path, b'{"n": 1}\n')
        assert reply == {"ok": True, "result": {"echo": {"n": 1}}}
        assert inbox.inputs == [{"n": 1}]
        assert not path.exists()

    async def test_raw_message(self, tmp_path: Path) -> None:
        """A line that is not JSON is delivered as text (a final newline is optional)."""
        path = tmp_path / "s"
        handler, inbox = SocketListen(path=path), Inbox()
        req = await setup(handler)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                async with await connect(path) as stream:
                    await stream.send(b"hello world")
                    await stream.send_eof()
                    reply = await read_reply(stream)
        assert reply == {"ok": True, "result": {"echo": "hello world"}}

    async def test_tcp(self) -> None:
        """A TCP listener works the same way."""
        port = free_port()
        handler, inbox = SocketListen(port=port), Inbox()
        req = await setup(handler)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                assert await ask(port, b"[1, 2]\n") == {"ok": True, "result": {"echo": [1, 2]}}
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", port)

    async def test_socket_mode(self, tmp_path: Path) -> None:
        """The socket file is created with mode 0o660."""
        path = tmp_path / "s"
        handler = SocketListen(path=path)
        req = await setup(handler)
        async with anyio.create_task_group() as tg:
            tg.start_soon(handler.listen, req, Inbox())
            await (await connect(path)).aclose()
            assert stat.S_IMODE(path.stat().st_mode) == 0o660
            tg.cancel_scope.cancel()


class TestClients:
    async def test_error_then_success(self, tmp_path: Path) -> None:
        """A rejected message gets an error reply and the listener keeps serving the next client."""
        path = tmp_path / "s"
        handler, inbox = SocketListen(path=path), Inbox(reject=1)
        req = await setup(handler)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                first = await ask(path, b"1\n")
                second = await ask(path, b"2\n")
        assert first == {"ok": False, "error": {"code": "bad_input", "message": "no thanks"}}
        assert second == {"ok": True, "result": {"echo": 2}}

    async def test_idle_client_does_not_block(self, tmp_path: Path) -> None:
        """A client that sends nothing does not hold up another one."""
        path = tmp_path / "s"
        handler, inbox = SocketListen(path=path, timeout=60), Inbox()
        req = await setup(handler)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                async with await connect(path) as idle:
                    assert await ask(path, b'"go"\n') == {"ok": True, "result": {"echo": "go"}}
                    assert await read_reply(idle) is None  # closed when the wait fired

    async def test_idle_client_times_out(self, tmp_path: Path) -> None:
        """A client that sends nothing gets a timeout error and is dropped."""
        path = tmp_path / "s"
        handler = SocketListen(path=path, timeout=0.1)
        req = await setup(handler)
        async with anyio.create_task_group() as tg:
            tg.start_soon(handler.listen, req, Inbox())
            async with await connect(path) as idle:
                reply = await read_reply(idle)
            tg.cancel_scope.cancel()
        assert reply["error"]["code"] == "timeout"

    async def test_oversized_line(self, tmp_path: Path) -> None:
        """A line over 1 MiB gets an error reply; the wait stays open for the next client."""
        path = tmp_path / "s"
        handler, inbox = SocketListen(path=path), Inbox()
        req = await setup(handler)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                async with await connect(path) as big:
                    with contextlib.suppress(
                        anyio.BrokenResourceError, OSError
                    ):  # it stopped reading
                        await big.send(b"x" * (MAX_LINE + 1))
                    reply = await read_reply(big)
                assert await ask(path, b"ok\n") == {"ok": True, "result": {"echo": "ok"}}
        assert reply["ok"] is False
        assert reply["error"]["code"] == "bad_request"
        assert inbox.inputs == ["ok"]

    async def test_deliver_crash(self, tmp_path: Path) -> None:
        """An unexpected error from deliver gets an internal error reply and ends listen with it."""
        path = tmp_path / "s"
        handler = SocketListen(path=path)
        req = await setup(handler)

        async def broken(input: Any) -> Any:
            raise RuntimeError("runtime bug")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    with pytest.raises(RuntimeError, match="runtime bug"):
                        await handler.listen(req, broken)

                tg.start_soon(run)
                reply = await ask(path, b"1\n")
        assert reply["error"]["code"] == "internal"
        assert not path.exists()


class TestTeardown:
    async def test_cancel_removes_listener(self, tmp_path: Path) -> None:
        """Cancelling a pending listen closes the listener and removes the socket file."""
        path = tmp_path / "s"
        handler, inbox = SocketListen(path=path), Inbox()
        req = await setup(handler)
        async with anyio.create_task_group() as tg:
            tg.start_soon(handler.listen, req, inbox)
            await (await connect(path)).aclose()
            tg.cancel_scope.cancel()
        assert not path.exists()
        await handler.teardown(req, False)
        await handler.teardown(req, False)
        assert inbox.inputs == []

    async def test_teardown_removes_stale_file(self, tmp_path: Path) -> None:
        """Teardown removes a socket file left behind by a listen that died."""
        path = tmp_path / "s"
        req = await setup(SocketListen(path=path))
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(path))
        stale.close()
        await SocketListen(path=path).teardown(req, False)
        assert not path.exists()

    async def test_never_steals_a_live_socket(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A socket someone else listens on is refused by listen and kept by teardown."""
        monkeypatch.setattr("handlers.listen.HANDOVER_S", 0.1)
        path = tmp_path / "s"
        req = await setup(SocketListen(path=path))
        async with await anyio.create_unix_listener(path):
            with pytest.raises(OSError) as info:
                await SocketListen(path=path).listen(req, Inbox())
            assert info.value.errno == errno.EADDRINUSE
            await SocketListen(path=path).teardown(req, False)
            assert path.exists()


class TestRestart:
    async def test_handover_to_the_next_wait(self, tmp_path: Path) -> None:
        """Once a message is delivered, the path leads to the next wait, even mid-reply."""
        path = tmp_path / "s"
        big = "x" * (8 << 20)  # more than the socket buffers hold: the reply blocks until read

        delivered = anyio.Event()

        async def bulky(input: Any) -> Any:
            delivered.set()
            return big

        first, second = SocketListen(path=path, timeout=30), SocketListen(path=path)
        req1, req2 = await setup(first), await setup(second)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(first.listen, req1, bulky)
                async with await connect(path) as client:
                    await client.send(b"1\n")
                    tg.start_soon(second.listen, req2, Inbox())
                    await delivered.wait()
                    # The first is still answering; the next client reaches the second.
                    assert await ask(path, b"2\n") == {"ok": True, "result": {"echo": 2}}
                    reader = BufferedByteReceiveStream(client)
                    reply = json.loads(await reader.receive_until(b"\n", 16 << 20))
        assert reply == {"ok": True, "result": big}
        assert not path.exists()

    async def test_listen_again_from_setup_data(self, tmp_path: Path) -> None:
        """After a crash leaves the socket file, listen re-opens it from the stored setup data."""
        path = tmp_path / "s"
        req = await setup(SocketListen(path=path))
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(path))
        stale.close()
        handler, inbox = SocketListen(path=path), Inbox()  # rebuilt, as after a restart
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                assert (await ask(path, b"1\n"))["ok"] is True
        assert not path.exists()
