"""A small HTTP/1.1 server on anyio: one request per connection, bounded, never fatal."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import anyio
import anyio.abc
import structlog

from daemon.errors import ConfigError

log = structlog.get_logger()
#: The request line and headers together; a longer head is refused.
MAX_HEAD = 16 * 1024
#: A request body (the dashboard's forms are tiny).
MAX_BODY = 64 * 1024
#: How long a client may take to send its request.
READ_TIMEOUT_S = 10.0
#: How long one write may wait for a client that does not read.
WRITE_TIMEOUT_S = 30.0
#: Connections at once; more are refused with 503.
MAX_CONNECTIONS = 64
#: A Unix socket's mode: the daemon's own group may scrape.
SOCKET_MODE = 0o660


@dataclass(slots=True)
class Request:
    """One parsed request."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes = b""

    def cookie(self, name: str) -> str | None:
        """Return one cookie's value, or None."""
        for part in self.headers.get("cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == name:
                return value
        return None

    def form(self) -> dict[str, str]:
        """Return the urlencoded body's fields."""
        return dict(parse_qsl(self.body.decode("utf-8", "replace")))


#: Writes one chunk of a streamed response; raises once the client has gone.
Send = Callable[[bytes], Awaitable[None]]


@dataclass(slots=True)
class Response:
    """One response: a body, or a stream written by `stream` (Server-Sent Events)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)
    stream: Callable[[Send], Awaitable[None]] | None = None


def text(status: int, message: str) -> Response:
    """Return a plain-text response."""
    return Response(status, (message + "\n").encode())


Handler = Callable[[Request], Awaitable[Response]]


def _drop_stale(path: Path) -> None:
    """Remove a socket left by a daemon that died; never another kind of file."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()


Listener = anyio.abc.Listener[anyio.abc.SocketStream]


@contextlib.asynccontextmanager
async def listening(address: str) -> AsyncIterator[Listener | None]:
    """Bind `address` ("" binds nothing) for the block; raise ConfigError if it cannot be."""
    if not address:
        yield None
        return
    listener = await _listen(address)
    async with listener:
        yield listener


async def _listen(address: str) -> Listener:
    """Bind "host:port" or a Unix socket path; a failure is a ConfigError naming the address."""
    listener: Listener
    try:
        if "/" in address:
            path = Path(address)
            _drop_stale(path)
            listener = await anyio.create_unix_listener(path)
            os.chmod(path, SOCKET_MODE)
        else:
            host, _, port = address.rpartition(":")
            listener = await anyio.create_tcp_listener(
                local_host=host.strip("[]"), local_port=int(port)
            )
    except OSError as e:
        raise ConfigError(f"cannot listen on {address}: {e.strerror or e}") from None
    log.info("http_listening", address=address)
    return listener


async def serve_http(listener: Listener, handler: Handler, *, name: str) -> None:
    """Serve `handler` on a bound listener until cancelled."""
    slots = anyio.Semaphore(MAX_CONNECTIONS)

    async def one(conn: anyio.abc.SocketStream) -> None:
        async with conn:
            if slots.value == 0:
                with contextlib.suppress(Exception):
                    await _send(conn, text(503, "too many connections"))
                return
            async with slots:
                try:
                    await _serve_one(conn, handler)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass  # the client went away
                except Exception:
                    log.exception("http_failed", server=name)

    await listener.serve(one)


def _gone(e: BaseException) -> bool:
    """Tell whether `e` (or every exception of a group) says the client went away."""
    if isinstance(e, BaseExceptionGroup):
        return all(_gone(x) for x in e.exceptions)
    return isinstance(e, anyio.BrokenResourceError | anyio.ClosedResourceError | OSError)


async def _serve_one(conn: anyio.abc.SocketStream, handler: Handler) -> None:
    with anyio.move_on_after(READ_TIMEOUT_S) as scope:
        parsed = await _read(conn)
    if scope.cancelled_caught:
        await _send(conn, text(408, "request timeout"))
        return
    if isinstance(parsed, Response):
        await _send(conn, parsed)
        return
    try:
        response = await handler(parsed)
    except Exception:
        log.exception("http_handler_failed", path=parsed.path)
        response = text(500, "internal error; the daemon's log has the traceback")
    await _send(conn, response)


async def _read(conn: anyio.abc.SocketStream) -> Request | Response:
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEAD:
            return text(431, "request head too large")
        try:
            buf += await conn.receive()
        except anyio.EndOfStream:
            return text(400, "incomplete request")
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return text(400, "bad request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if not sep:
            return text(400, "bad header line")
        headers[key.strip().lower()] = value.strip()
    length_text = headers.get("content-length", "0")
    if not length_text.isdigit():
        return text(400, "bad content-length")
    length = int(length_text)
    if length > MAX_BODY:
        return text(413, "request body too large")
    body = bytearray(rest)
    while len(body) < length:
        try:
            body += await conn.receive()
        except anyio.EndOfStream:
            return text(400, "incomplete body")
    url = urlsplit(parts[1])
    return Request(
        method=parts[0].upper(),
        path=url.path or "/",
        query=dict(parse_qsl(url.query)),
        headers=headers,
        body=bytes(body[:length]),
    )


async def _send(conn: anyio.abc.SocketStream, r: Response) -> None:
    async def write(chunk: bytes) -> None:
        # A client that stops reading must not hold its slot (and a log subscription) forever.
        with anyio.fail_after(WRITE_TIMEOUT_S):
            await conn.send(chunk)

    reason = HTTPStatus(r.status).phrase if r.status in HTTPStatus._value2member_map_ else ""
    head = [f"HTTP/1.1 {r.status} {reason}", f"Content-Type: {r.content_type}"]
    head += ["Connection: close", "X-Content-Type-Options: nosniff", "Cache-Control: no-store"]
    head += [f"{k}: {v}" for k, v in r.headers]
    if r.stream is None:
        head.append(f"Content-Length: {len(r.body)}")
        await write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + r.body)
        return
    await write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
    await r.stream(write)
