"""Fan-out benchmark: one workflow of 64 Go threads of 10 steps against 64 workflows of 10.

Both run the same 640 trivial sync steps in a fresh in-process runtime on a real SQLite file
(synchronous=normal) with the daemon's info-level logging. In the fan-out, the threads' steps
overlap and each one's change is merged into the one workflow's data when it completes.
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

from .bench_workflows import FanSteps, SyncSteps
from .common import production_logging

THREADS, STEPS = 64, 10
REGISTRY: dict[str, type[Workflow]] = {cls.name: cls for cls in (FanSteps, SyncSteps)}
REPEATS = 3
#: The fan-out's steps/s may be at most this much slower than the separate workflows'.
TARGET_RATIO = 1.5


async def _timed(db: Path, starts: list[tuple[str, str, dict[str, Any]]]) -> tuple[float, float]:
    """Start the workflows together; return the wall and CPU seconds until all finished."""
    async with (
        SQLiteStore.open(db, synchronous="normal") as store,
        Runtime.open(store, REGISTRY) as rt,
    ):
        began, cpu = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for workflow, workflow_id, input in starts:
                tg.start_soon(rt.start, workflow, workflow_id, input)
        await rt.wait_idle()
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
        counts = await rt.counts()
    if counts != {"Finished": len(starts)}:
        raise AssertionError(f"expected {len(starts)} finished workflows, got {counts}")
    return elapsed, cpu


async def run(
    tmp: Path,
    threads: int = THREADS,
    steps: int = STEPS,
    repeats: int = REPEATS,
    cache_loggers: bool = True,
) -> list[dict[str, Any]]:
    """Return steps/s and wall time of the fan-out and of separate workflows (median of repeats)."""
    total = threads * steps
    fan = [("FanSteps", "fan", {"threads": threads, "n": steps})]
    separate = [("SyncSteps", f"w{i}", {"n": steps}) for i in range(threads)]
    walls: dict[str, list[float]] = {"fan_out": [], "separate": []}
    cpus: dict[str, list[float]] = {"fan_out": [], "separate": []}
    with production_logging(cache_loggers):
        for r in range(repeats):
            for shape, starts in (("fan_out", fan), ("separate", separate)):
                elapsed, cpu = await _timed(tmp / f"{shape}-{r}.db", starts)
                walls[shape].append(elapsed)
                cpus[shape].append(cpu)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    rate = {k: total / v for k, v in wall.items()}
    context = {"threads": threads, "steps_each": steps, "synchronous": "normal"}
    figures: list[dict[str, Any]] = []
    for shape in ("fan_out", "separate"):
        target = rate["separate"] / TARGET_RATIO if shape == "fan_out" else None
        figures += [
            {"bench": "fanout", "metric": f"{shape}_steps_per_s", "value": round(rate[shape]),
             "unit": "1/s", "target": target and round(target), **context},
            {"bench": "fanout", "metric": f"{shape}_wall_ms", "value": round(wall[shape] * 1e3, 1),
             "unit": "ms", "target": None, **context,
             "runs": [round(w * 1e3, 1) for w in walls[shape]]},
            {"bench": "fanout", "metric": f"{shape}_cpu_per_step_us",
             "value": round(statistics.median(cpus[shape]) / total * 1e6), "unit": "us",
             "target": None, **context},
        ]  # fmt: skip
    figures.append(
        {"bench": "fanout", "metric": "slowdown", "value": round(wall["fan_out"] / wall["separate"], 2),
         "unit": "x", "target": TARGET_RATIO, **context}
    )  # fmt: skip
    return figures
