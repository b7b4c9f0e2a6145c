"""SQLiteStore benchmark: durable checkpoints per second and CPU each, one caller versus many."""

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


#: checkpoints/s and the process's CPU µs per checkpoint (every thread: the writer's too)
Timed = tuple[float, float]


def writer_cpu_s(store: SQLiteStore) -> float:
    """Return the CPU seconds the store's writer thread has used (its own clock, not sampled)."""
    thread = store._writes._thread
    assert thread is not None and thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


async def _sequential(store: SQLiteStore, n: int = SEQUENTIAL) -> tuple[Timed, float]:
    """Return checkpoints/s and CPU per checkpoint, and the writer thread's CPU µs per one."""
    await store.create(WorkflowRow("seq", "Bench", "Resuming", DATA, STATE))
    cpu, start, thread = time.process_time(), time.perf_counter(), writer_cpu_s(store)
    for i in range(n):
        await _checkpoint(store, "seq", i)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return (n / elapsed, cpu / n * 1e6), (writer_cpu_s(store) - thread) / n * 1e6


async def _concurrent(
    store: SQLiteStore, callers: int = CALLERS, each: int = PER_CALLER
) -> tuple[Timed, int, int, float]:
    """Return checkpoints/s, CPU per checkpoint, the commits and writes the timed part made,
    and the writer thread's CPU µs per checkpoint.
    """
    for c in range(callers):
        await store.create(WorkflowRow(f"c{c}", "Bench", "Resuming", DATA, STATE))

    async def caller(wid: str) -> None:
        for n in range(each):
            await _checkpoint(store, wid, n)

    commits, writes = store.stats.commits, store.stats.writes
    cpu, start, thread = time.process_time(), time.perf_counter(), writer_cpu_s(store)
    async with anyio.create_task_group() as tg:
        for c in range(callers):
            tg.start_soon(caller, f"c{c}")
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    total = callers * each
    timed = (total / elapsed, cpu / total * 1e6)
    thread_us = (writer_cpu_s(store) - thread) / total * 1e6
    return timed, store.stats.commits - commits, store.stats.writes - writes, thread_us


async def bench_group_commit(
    tmp: Path,
    sequential: int = SEQUENTIAL,
    callers: int = CALLERS,
    each: int = PER_CALLER,
    modes: tuple[str, ...] = ("full", "normal"),
) -> list[dict[str, Any]]:
    """Measure checkpoints/s and CPU per checkpoint and per commit, sequential and concurrent.

    CPU is the process's (time.process_time: the loop's and the writer thread's together),
    which a shared machine disturbs far less than the wall-clock rates.
    """
    figures: list[dict[str, Any]] = []
    for sync in modes:
        async with SQLiteStore.open(tmp / f"seq-{sync}.db", synchronous=sync) as store:
            (seq_rate, seq_cpu), seq_thread_us = await _sequential(store, sequential)
        async with SQLiteStore.open(tmp / f"conc-{sync}.db", synchronous=sync) as store:
            (rate, cpu), commits, writes, thread_us = await _concurrent(store, callers, each)
        per_commit = cpu * writes / max(commits, 1)
        figures.append(
            {
                "bench": "store_group_commit",
                "synchronous": sync,
                "sequential_checkpoints_per_s": round(seq_rate),
                "sequential_cpu_per_checkpoint_us": round(seq_cpu, 1),
                # One write per commit: the writer thread's cost of a batch of one.
                "sequential_writer_thread_cpu_per_checkpoint_us": round(seq_thread_us, 1),
                "concurrent_callers": callers,
                "concurrent_checkpoints_per_s": round(rate),
                "concurrent_cpu_per_checkpoint_us": round(cpu, 1),
                "concurrent_cpu_per_commit_us": round(per_commit),
                "concurrent_commits": commits,
                "writes_per_commit": round(writes / max(commits, 1), 1),
                # The writer thread's share of the CPU per checkpoint: SQLite's work and the
                # store's Python per row, some of it holding the GIL the loop needs.
                "concurrent_writer_thread_cpu_per_checkpoint_us": round(thread_us, 1),
            }
        )
    return figures


async def _main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for figure in await bench_group_commit(Path(tmp)):
            print(json.dumps(figure), flush=True)


if __name__ == "__main__":
    anyio.run(_main)
