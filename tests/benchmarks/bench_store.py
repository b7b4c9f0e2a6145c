"""SQLiteStore benchmark: durable checkpoints per second, one caller versus many."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from daemon.store.base import WorkflowRow
from daemon.store.sqlite import SQLiteStore

SEQUENTIAL = 1_000
CALLERS = 200
PER_CALLER = 10
DATA = '{"user":"alice","count":0,"items":["a","b","c"],"note":"' + "x" * 120 + '"}'
STATE = '{"threads":[{"id":"main","cur_step":"loop","status":"Resuming","wait":[]}],"pc":7}'


async def _checkpoint(store: SQLiteStore, wid: str, n: int) -> None:
    await store.checkpoint(
        wid, status="Resuming", data=DATA, state=STATE, history=[("step", {"name": f"s{n}"})]
    )


async def _sequential(store: SQLiteStore) -> float:
    await store.create(WorkflowRow("seq", "Bench", "Resuming", DATA, STATE))
    start = time.perf_counter()
    for n in range(SEQUENTIAL):
        await _checkpoint(store, "seq", n)
    return SEQUENTIAL / (time.perf_counter() - start)


async def _concurrent(store: SQLiteStore) -> tuple[float, int, int]:
    """Return checkpoints/s and the commits and writes the timed part made."""
    for c in range(CALLERS):
        await store.create(WorkflowRow(f"c{c}", "Bench", "Resuming", DATA, STATE))

    async def caller(wid: str) -> None:
        for n in range(PER_CALLER):
            await _checkpoint(store, wid, n)

    commits, writes = store.stats.commits, store.stats.writes
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for c in range(CALLERS):
            tg.start_soon(caller, f"c{c}")
    rate = CALLERS * PER_CALLER / (time.perf_counter() - start)
    return rate, store.stats.commits - commits, store.stats.writes - writes


async def bench_group_commit(tmp: Path) -> dict[str, Any]:
    """Measure checkpoints/s for 1 sequential caller and for 200 concurrent callers."""
    async with SQLiteStore.open(tmp / "bench_seq.db", synchronous="normal") as store:
        sequential = await _sequential(store)
    async with SQLiteStore.open(tmp / "bench_conc.db", synchronous="normal") as store:
        concurrent, commits, writes = await _concurrent(store)
    return {
        "bench": "store_group_commit",
        "synchronous": "normal",
        "sequential_checkpoints_per_s": round(sequential),
        "concurrent_callers": CALLERS,
        "concurrent_checkpoints_per_s": round(concurrent),
        "concurrent_commits": commits,
        "writes_per_commit": round(writes / max(commits, 1), 1),
    }


async def _main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(await bench_group_commit(Path(tmp))), flush=True)


if __name__ == "__main__":
    anyio.run(_main)
