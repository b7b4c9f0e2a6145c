"""A tiny HTTP client for the daemon's `/metrics` and dashboard, over TCP or a Unix socket."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import anyio
import anyio.abc
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Reply:
    """One HTTP response."""

    status: int
    headers: dict[str, str]
    body: bytes


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def fetch(
    address: str,
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes = b"",
) -> Reply:
    """Send one request to `address` ("host:port" or a socket path); read the whole answer."""
    stream: anyio.abc.SocketStream
    if "/" in address:
        stream = await anyio.connect_unix(address)
    else:
        host, _, port = address.rpartition(":")
        stream = await anyio.connect_tcp(host, int(port))
    head = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    async with stream:
        await stream.send(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = bytearray()
        with anyio.fail_after(20):
            while True:
                try:
                    data += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    top, _, rest = bytes(data).partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        fields[k.strip().lower()] = v.strip()
    return Reply(int(lines[0].split(" ")[1]), fields, rest)


async def writes_committed(address: str) -> float:
    """Return how many writes the daemon has committed so far (from `/metrics`)."""
    reply = await fetch(address, "/metrics")
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            if s.name == "workflowd_commit_batch_size_sum":
                return float(s.value)
    raise AssertionError("no workflowd_commit_batch_size_sum in /metrics")
