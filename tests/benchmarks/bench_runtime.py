"""Runtime benchmark: durable steps per second, one long workflow versus many short ones.

Each step is trivial, so the figure is the runtime's own cost per durable step: the
engine's resume, JSON of data and state, one checkpoint committed on a real SQLite file,
and the daemon's info-level logging. Each figure is taken at synchronous=normal (the
metric names without a suffix) and at synchronous=full (the names ending in `_full`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from daemon.core.workflow import Workflow
from daemon.runtime.runtime import Runtime
from daemon.store.sqlite import SQLiteStore
from tests.helpers.harness import Daemon

from .bench_workflows import AsyncSteps, SyncSteps
from .common import (
    bench_daemon,
    call_many,
    cpu_s,
    production_logging,
    query,
    until_count,
)

#: name -> (workflows started together, steps each, target steps/s)
SHAPES: dict[str, tuple[int, int, float]] = {
    "one_workflow": (1, 1_000, 3_000.0),
    "many_workflows": (200, 10, 15_000.0),
}
KINDS: dict[str, type[Workflow]] = {"sync": SyncSteps, "async": AsyncSteps}
REGISTRY = {cls.name: cls for cls in KINDS.values()}
REPEATS = 3
#: synchronous mode -> the suffix of its metric names (normal keeps the original names)
MODES: dict[str, str] = {"normal": "", "full": "_full"}
#: (shape, kind) -> target steps/s at synchronous=full (issue 16); SHAPES has normal's
FULL_TARGETS: dict[tuple[str, str], float] = {
    ("one_workflow", "sync"): 7_000.0,
    ("many_workflows", "sync"): 30_000.0,
    ("many_workflows", "async"): 40_000.0,
}


#: steps/s and CPU µs per step (all threads of the process that runs the runtime)
Result = tuple[float, float]


async def in_process(
    db: Path, kind: str, workflows: int, steps: int, synchronous: str = "normal"
) -> Result:
    """Start `workflows` workflows together in a fresh in-process runtime; return steps/s."""
    async with (
        SQLiteStore.open(db, synchronous=synchronous) as store,
        Runtime.open(store, REGISTRY) as rt,
    ):
        cpu = time.process_time()
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(workflows):
                tg.start_soon(rt.start, kind, f"w{i}", {"n": steps})
        await rt.wait_idle()
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        counts = await rt.counts()
    if counts != {"Finished": workflows}:
        raise AssertionError(f"expected {workflows} finished workflows, got {counts}")
    total = workflows * steps
    return total / elapsed, cpu / total * 1e6


async def through_daemon(d: Daemon, tag: str, kind: str, n: int, steps: int) -> Result:
    """Start `n` workflows together over the control socket; return steps/s.

    The end is the last checkpoint's `updated_at` as the daemon stored it, so polling for
    completion adds nothing to the time measured.
    """
    requests = [
        {"op": "start", "workflow": kind, "workflow_id": f"{tag}-{i}", "input": {"n": steps}}
        for i in range(n)
    ]
    assert d.proc is not None
    like, db = (f"{tag}-%",), d.tmp / "wd.db"
    cpu = cpu_s(d.proc.pid)
    start = time.time()
    await call_many(d.socket, requests, connections=min(n, 8))
    finished = "SELECT COUNT(*) FROM workflows WHERE id LIKE ? AND status = 'Finished'"
    await until_count(db, finished, like, n, limit_s=300, every_s=0.02)
    cpu = cpu_s(d.proc.pid) - cpu
    (end,) = query(db, "SELECT MAX(updated_at) FROM workflows WHERE id LIKE ?", like)[0]
    return n * steps / (float(end) - start), cpu / (n * steps) * 1e6


def _figures(
    mode: str,
    shape: str,
    kind: str,
    size: tuple[int, int, float],
    results: list[Result],
    synchronous: str = "normal",
) -> list[dict[str, Any]]:
    workflows, steps, target_normal = size
    target: float | None = target_normal
    rates, cpus = [r for r, _ in results], [c for _, c in results]
    context = {"mode": mode, "workflows": workflows, "steps_each": steps,
               "synchronous": synchronous}  # fmt: skip
    sync = MODES[synchronous]
    if synchronous == "full":
        target = FULL_TARGETS.get((shape, kind))
    return [
        {"bench": "runtime", "metric": f"{shape}_{kind}{sync}_steps_per_s",
         "value": round(statistics.median(rates)), "unit": "1/s", "target": target,
         **context, "runs": [round(r) for r in rates]},
        {"bench": "runtime", "metric": f"{shape}_{kind}{sync}_cpu_per_step_us",
         "value": round(statistics.median(cpus)), "unit": "us", "target": None,
         **context, "runs": [round(c) for c in cpus]},
    ]  # fmt: skip


async def run(
    tmp: Path,
    shapes: dict[str, tuple[int, int, float]] | None = None,
    repeats: int = REPEATS,
    daemon: bool = True,
    cache_loggers: bool = True,
) -> list[dict[str, Any]]:
    """Measure steps/s (median of `repeats`) in process and through a real workflowd."""
    shapes = shapes or SHAPES
    figures = []
    with production_logging(cache_loggers):
        for sync in MODES:
            for shape, (workflows, steps, _) in shapes.items():
                for kind, cls in KINDS.items():
                    results = [
                        await in_process(
                            tmp / f"{sync}-{shape}-{kind}-{r}.db", cls.name, workflows, steps, sync
                        )
                        for r in range(repeats)
                    ]
                    figures += _figures("in_process", shape, kind, shapes[shape], results, sync)
    if daemon:
        for sync in MODES:
            store = {"synchronous": sync}
            async with bench_daemon(tmp / f"daemon-{sync}", store=store) as d:
                for shape, (workflows, steps, _) in shapes.items():
                    for kind, cls in KINDS.items():
                        results = [
                            await through_daemon(
                                d, f"{shape}-{kind}-{r}", cls.name, workflows, steps
                            )
                            for r in range(repeats)
                        ]
                        figures += _figures("workflowd", shape, kind, shapes[shape], results, sync)
    return figures
