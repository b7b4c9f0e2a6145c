"""Protocol clients for tests: an async JSON-lines client and a ping run as another user."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc


class Client:
    """One JSON-lines connection to the control socket; requests answered in order."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.ids = itertools.count(1)

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return its response object."""
        rid = next(self.ids)
        await self.stream.send(json.dumps({"id": rid, "op": op, **fields}).encode() + b"\n")
        return await self.read()

    async def read(self) -> dict[str, Any]:
        """Read the next response line."""
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive(65536)
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        response: dict[str, Any] = json.loads(line)
        return response

    async def call(self, op: str, **fields: Any) -> Any:
        """Send a request and return its result, failing the test on an error response."""
        response = await self.request(op, **fields)
        assert response["ok"], response
        return response["result"]


@asynccontextmanager
async def connect(socket_path: Path) -> AsyncIterator[Client]:
    """Open a client connection."""
    async with await anyio.connect_unix(socket_path) as stream:
        yield Client(stream)


#: A client, run as another user, that pings the socket at argv[1] and prints the reply line.
PING_CHILD = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
try:
    s.sendall(b'{"op": "ping", "id": 1}\\n')
except BrokenPipeError:
    pass  # a refused client is told so at once; the reply is still there to read
print(s.makefile("rb").readline().decode(), end="")
"""


async def ping_as_nobody(path: Path) -> dict[str, Any]:
    """Ping from a child running as uid/gid 65534 (needs root and setpriv); return its reply."""
    drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    with anyio.fail_after(30):
        done = await anyio.run_process(
            [*drop, sys.executable, "-I", "-c", PING_CHILD, str(path)], check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def ping_as(path: Path, uid: int, gid: int, groups: list[int]) -> dict[str, Any]:
    """Ping from a child running as `uid`/`gid` with exactly `groups` (root and setpriv)."""
    extra = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    drop = ["setpriv", "--reuid", str(uid), "--regid", str(gid), *extra]
    with anyio.fail_after(30):
        done = await anyio.run_process(
            [*drop, sys.executable, "-I", "-c", PING_CHILD, str(path)], check=False
        )
    if done.returncode != 0:  # Unix permissions refused the connection itself
        return {"ok": False, "error": {"code": "EACCES", "message": done.stderr.decode()}}
    result: dict[str, Any] = json.loads(done.stdout)
    return result
