"""Shared parts of the daemon benchmarks: production logging, a real daemon, a pipelined client."""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import structlog

from daemon.service.log import LogHub, close_logging, configure_logging
from tests.helpers.client import connect
from tests.helpers.harness import Daemon, running_daemon

MODULES = ["tests.benchmarks.bench_workflows"]


@contextmanager
def production_logging(cache: bool = True) -> Iterator[None]:
    """Log as workflowd does (JSON lines at info, plus the live hub) into /dev/null, then restore.

    workflowd caches loggers; pass `cache=False` inside a test process, or module loggers used
    during the block would keep writing to /dev/null afterwards.
    """
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with open(os.devnull, "w") as sink:
        configure_logging("info", "json", stream=sink, cache=cache, hub=LogHub())
        try:
            yield
        finally:
            close_logging()
            structlog.configure(**saved)
            for h in root.handlers[:]:
                if h not in handlers:
                    root.removeHandler(h)
            root.setLevel(level)


def percentile(values: Sequence[float], p: float) -> float:
    """Return the p-th percentile (nearest rank) of `values`."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[rank]


def rss_mb(pid: int) -> float:
    """Return a process's resident set size (VmRSS) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """Return the CPU seconds (user + system, all threads) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@asynccontextmanager
async def bench_daemon(tmp: Path, **sections: dict[str, Any]) -> AsyncIterator[Daemon]:
    """Run a real workflowd (synchronous=normal, JSON logs to a file) on the bench workflows."""
    await anyio.Path(tmp).mkdir(parents=True, exist_ok=True)
    store = {"synchronous": "normal", **sections.pop("store", {})}
    async with running_daemon(tmp, MODULES, store=store, **sections) as d:
        yield d


async def call_many(
    socket: Path, requests: Sequence[dict[str, Any]], connections: int = 8
) -> list[dict[str, Any]]:
    """Send every request, pipelined over `connections` connections; return responses in order."""
    responses: list[dict[str, Any]] = [{}] * len(requests)

    async def one(indexes: range) -> None:
        async with connect(socket) as c:

            async def write() -> None:
                for i in indexes:
                    line = json.dumps({"id": i, **requests[i]}).encode() + b"\n"
                    await c.stream.send(line)

            async with anyio.create_task_group() as tg:
                tg.start_soon(write)
                for _ in indexes:
                    response = await c.read()
                    responses[response["id"]] = response

    step = max(1, -(-len(requests) // connections))
    async with anyio.create_task_group() as tg:
        for first in range(0, len(requests), step):
            tg.start_soon(one, range(first, min(first + step, len(requests))))
    failed = [r for r in responses if not r.get("ok")]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return responses


def query(db: Path, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    """Run one read-only query on a daemon's database (WAL: it does not block the daemon)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


async def until_count(
    db: Path, sql: str, params: Sequence[Any], want: int, limit_s: float, every_s: float = 0.01
) -> None:
    """Poll `sql` (a COUNT) until it returns `want`; fail after `limit_s`."""
    with anyio.fail_after(limit_s):
        while True:
            if query(db, sql, params)[0][0] >= want:
                return
            await anyio.sleep(every_s)
