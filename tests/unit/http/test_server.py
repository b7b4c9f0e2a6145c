"""The small HTTP server: bad requests get a clear status, a failing handler a 500, and it lives on."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.abc
import pytest

from daemon.errors import ConfigError
from daemon.http.server import MAX_BODY, MAX_HEAD, Request, Response, listening, serve_http, text
from tests.helpers.http import fetch


async def _handler(request: Request) -> Response:
    if request.path == "/boom":
        raise RuntimeError("a bug")
    return text(200, f"{request.method} {request.path} {sorted(request.query.items())}")


async def _raw(path: Path, data: bytes) -> bytes:
    async with await anyio.connect_unix(path) as s:
        await s.send(data)
        out = bytearray()
        with anyio.fail_after(10):
            while True:
                try:
                    out += await s.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return bytes(out)


async def test_requests_and_refusals(short_tmp: Path) -> None:
    """Parsed requests reach the handler; bad ones are answered without it; a bug is a 500."""
    sock = short_tmp / "h.sock"
    async with listening(str(sock)) as listener, anyio.create_task_group() as tg:
        assert listener is not None
        tg.start_soon(lambda: serve_http(listener, _handler, name="test"))
        ok = await fetch(str(sock), "/x?a=1&b=two")
        assert ok.status == 200 and ok.body == b"GET /x [('a', '1'), ('b', 'two')]\n"
        assert (await fetch(str(sock), "/boom")).status == 500
        assert (await _raw(sock, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400")
        assert (await _raw(sock, b"GET / HTTP/1.1\r\nno colon\r\n\r\n")).startswith(b"HTTP/1.1 400")
        huge_head = b"GET / HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD + 10)
        assert (await _raw(sock, huge_head)).startswith(b"HTTP/1.1 431")
        big = f"POST / HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
        assert (await _raw(sock, big)).startswith(b"HTTP/1.1 413")
        assert (await fetch(str(sock), "/still")).status == 200  # it lives on
        tg.cancel_scope.cancel()


async def test_address_in_use_is_a_config_error(short_tmp: Path) -> None:
    """A port that is taken is refused with a ConfigError naming the address."""
    async with listening("127.0.0.1:0") as first:
        assert first is not None
        port = first.extra(anyio.abc.SocketAttribute.local_port)
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            async with listening(f"127.0.0.1:{port}"):
                pass
    async with listening("") as none:
        assert none is None
