"""PostgreSQL benchmark: steps/s with one, two and three daemons on one database, and takeover.

The daemons run on a throwaway cluster (tests/helpers/postgres: $WORKFLOWD_TEST_DSN's, or
one started here as `postgres`). Workflows are started through the first daemon; every daemon
claims its share. Beside steps/s (wall clock: noisy on a shared machine) each group reports
the daemons' CPU per step (their user + system time over the steps run). Takeover is the time
from SIGKILL of one of two daemons to the other holding every workflow the dead one held.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from tests.helpers.harness import Daemon, write_config
from tests.helpers.postgres import Cluster, drop_database, find_or_start, fresh_database

from .common import MODULES, call_many

LEASE_S = 15.0


def _daemon(root: Path, name: str, dsn: str, lease_s: float) -> Daemon:
    tmp = root / name
    tmp.mkdir(parents=True)
    store = {"backend": "postgres", "dsn": dsn, "node_id": name, "lease_s": lease_s}
    return Daemon(tmp, write_config(tmp, MODULES, store=store))


async def _group(root: Path, dsn: str, n: int, lease_s: float) -> list[Daemon]:
    """Start `n` daemons sharing `dsn`."""
    daemons = [_daemon(root, f"node{i}", dsn, lease_s) for i in range(n)]
    for d in daemons:
        await d.start()
    return daemons


def _cpu_s(daemons: list[Daemon]) -> float:
    """Return the user + system CPU seconds the daemons used so far."""
    total = 0.0
    for d in daemons:
        assert d.proc is not None
        fields = Path(f"/proc/{d.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _stop(daemons: list[Daemon]) -> None:
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()


async def _finished_at(dsn: str, want: int, limit_s: float) -> float:
    """Wait until `want` workflows finished; return the last one's `updated_at`."""
    conn = await asyncpg.connect(dsn)
    try:
        with anyio.fail_after(limit_s):
            while True:
                row = await conn.fetchrow(
                    "SELECT COUNT(*), MAX(updated_at) FROM workflows WHERE status = 'Finished'"
                )
                assert row is not None
                count, end = row
                if count >= want:
                    return float(end)
                await anyio.sleep(0.02)
    finally:
        await conn.close()


async def steps_per_s(
    cluster: Cluster, root: Path, nodes: int, workflows: int, steps: int, lease_s: float
) -> tuple[float, float]:
    """Start `workflows` x `steps` through the first of `nodes` daemons; return steps/s and
    the daemons' CPU milliseconds per step."""
    dsn = fresh_database(cluster)
    daemons: list[Daemon] = []
    try:
        daemons = await _group(root, dsn, nodes, lease_s)
        requests = [
            {"op": "start", "workflow": "SyncSteps", "workflow_id": f"w{i}", "input": {"n": steps}}
            for i in range(workflows)
        ]
        cpu = _cpu_s(daemons)
        began = time.time()
        await call_many(daemons[0].socket, requests, connections=min(workflows, 8))
        end = await _finished_at(dsn, workflows, limit_s=600)
        cpu = _cpu_s(daemons) - cpu
        return workflows * steps / (end - began), 1000 * cpu / (workflows * steps)
    finally:
        await _stop(daemons)
        drop_database(cluster, dsn)


async def takeover_s(cluster: Cluster, root: Path, workflows: int, lease_s: float) -> float:
    """SIGKILL one of two daemons holding `workflows` waiting ones between them; return how
    long until the other one holds every workflow the dead one held."""
    dsn = fresh_database(cluster)
    daemons: list[Daemon] = []
    try:
        daemons = await _group(root, dsn, 2, lease_s)
        requests = [
            {"op": "start", "workflow": "Pinged", "workflow_id": f"w{i}"} for i in range(workflows)
        ]
        await call_many(daemons[0].socket, requests, connections=8)
        dead = daemons[0]
        conn = await asyncpg.connect(dsn)
        try:
            sql = (
                "SELECT COUNT(*) FROM workflows WHERE owner LIKE $1"
                " AND status NOT IN ('Finished', 'Failed', 'Cancelled')"
                " AND lease_until > extract(epoch FROM clock_timestamp())"
            )

            async def held(by: str) -> int:
                count: int = await conn.fetchval(sql, by)
                return count

            with anyio.fail_after(60):  # every workflow claimed by one of the two
                while await held("%") < workflows:  # noqa: ASYNC110 - another process's rows
                    await anyio.sleep(0.05)
            assert dead.proc is not None
            killed = time.monotonic()
            dead.proc.send_signal(signal.SIGKILL)
            with anyio.fail_after(lease_s + 30):
                while await held("workflowd node1 %") < workflows:  # noqa: ASYNC110 - as above
                    await anyio.sleep(0.01)
            return time.monotonic() - killed
        finally:
            await conn.close()
    finally:
        await _stop(daemons)
        drop_database(cluster, dsn)


async def run(
    tmp: Path,
    workflows: int = 200,
    steps: int = 10,
    nodes: tuple[int, ...] = (1, 2, 3),
    lease_s: float = LEASE_S,
    cluster: Cluster | None = None,
) -> list[dict[str, Any]]:
    """Measure steps/s per group size, and the takeover time after a SIGKILL."""
    own = cluster is None
    if cluster is None:
        cluster, reason = find_or_start()
        if cluster is None:
            raise RuntimeError(f"no PostgreSQL server: {reason}")
    figures: list[dict[str, Any]] = []
    try:
        base = 0.0
        for n in nodes:
            rate, cpu_ms = await steps_per_s(
                cluster, tmp / f"rate{n}", n, workflows, steps, lease_s
            )
            base = base or rate
            figures.append(
                {"bench": "postgres", "metric": f"daemons_{n}_steps_per_s", "value": round(rate),
                 "unit": "1/s", "target": None if n == 1 else round(1.5 * base),
                 "workflows": workflows, "steps_each": steps, "daemons": n}
            )  # fmt: skip
            figures.append(
                {"bench": "postgres", "metric": f"daemons_{n}_cpu_ms_per_step",
                 "value": round(cpu_ms, 3), "unit": "ms", "target": None, "daemons": n}
            )  # fmt: skip
        took = await takeover_s(cluster, tmp / "takeover", workflows, lease_s)
        figures.append(
            {"bench": "postgres", "metric": "takeover_after_sigkill_s", "value": round(took, 2),
             "unit": "s", "target": lease_s + 1, "workflows": workflows, "lease_s": lease_s}
        )  # fmt: skip
    finally:
        if own:
            cluster.stop()
    return figures
