"""Probes of what a process holds: inotify and socket descriptors, bound Unix sockets.

Plus `exchange`, a one-line client for a SocketListen. Read /proc, so Linux only.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import anyio.abc


def fds(pid: int | str = "self") -> Counter[str]:
    """Count a process's open inotify and socket file descriptors."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while listing
        if target == "anon_inode:inotify":
            kinds["inotify"] += 1
        elif target.startswith("socket:"):
            kinds["socket"] += 1
    return kinds


def unix_sockets(path: Path) -> list[int]:
    """Return the flags of every socket in this network namespace bound to `path`."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [int(row[3], 16) for row in rows if row[7:] == [str(path)]]


def unix_bound(path: Path) -> bool:
    """Tell whether any socket (listening, accepted or just bound) still holds `path`."""
    return bool(unix_sockets(path))


def unix_listening(path: Path) -> bool:
    """Tell whether a socket listens on `path` (flag __SO_ACCEPTCON), so a connect succeeds."""
    return any(flags & 0x10000 for flags in unix_sockets(path))


async def exchange(path: Path | None = None, port: int | None = None, line: bytes = b"") -> Any:
    """Connect to a SocketListen, send one line and return its JSON reply."""
    with anyio.fail_after(10):
        stream: anyio.abc.SocketStream
        if path is not None:
            stream = await anyio.connect_unix(path)
        else:
            stream = await anyio.connect_tcp("127.0.0.1", port or 0)
        async with stream:
            await stream.send(line + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                data += await stream.receive()
    return json.loads(data)
