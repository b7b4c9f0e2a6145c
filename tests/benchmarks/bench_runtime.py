"""Runtime benchmark: durable steps per second, one long workflow versus many short ones.

Each step is trivial, so the figure is the runtime's own cost per durable step: the
engine's resume, JSON of data and state, one checkpoint committed with
synchronous=normal on a real SQLite file, and the daemon's info-level logging.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from daemon.runtime import Runtime
from daemon.store import Store
from daemon.workflow import Workflow

from .bench_workflows import AsyncSteps, SyncSteps
from .common import bench_daemon, call_many, production_logging, query, until_count

#: name -> (workflows started together, steps each, target steps/s)
SHAPES: dict[str, tuple[int, int, float]] = {
    "one_workflow": (1, 1_000, 3_000.0),
    "many_workflows": (200, 10, 15_000.0),
}
KINDS: dict[str, type[Workflow]] = {"sync": SyncSteps, "async": AsyncSteps}
REGISTRY = {cls.name: cls for cls in KINDS.values()}
REPEATS = 3


async def in_process(db: Path, kind: str, workflows: int, steps: int) -> float:
    """Start `workflows` workflows together in a fresh in-process runtime; return steps/s."""
    async with Store.open(db, synchronous="normal") as store, Runtime.open(store, REGISTRY) as rt:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(workflows):
                tg.start_soon(rt.start, kind, f"w{i}", {"n": steps})
        await rt.wait_idle()
        elapsed = time.perf_counter() - start
        counts = await rt.counts()
    if counts != {"Finished": workflows}:
        raise AssertionError(f"expected {workflows} finished workflows, got {counts}")
    return workflows * steps / elapsed


async def through_daemon(socket: Path, db: Path, tag: str, kind: str, n: int, steps: int) -> float:
    """Start `n` workflows together over the control socket; return steps/s.

    The end is the last checkpoint's `updated_at` as the daemon stored it, so polling for
    completion adds nothing to the time measured.
    """
    requests = [
        {"op": "start", "workflow": kind, "workflow_id": f"{tag}-{i}", "input": {"n": steps}}
        for i in range(n)
    ]
    like = (f"{tag}-%",)
    start = time.time()
    await call_many(socket, requests, connections=min(n, 8))
    finished = "SELECT COUNT(*) FROM workflows WHERE id LIKE ? AND status = 'Finished'"
    await until_count(db, finished, like, n, limit_s=300, every_s=0.02)
    (end,) = query(db, "SELECT MAX(updated_at) FROM workflows WHERE id LIKE ?", like)[0]
    return n * steps / (float(end) - start)


def _figure(
    mode: str, shape: str, kind: str, size: tuple[int, int, float], rates: list[float]
) -> dict[str, Any]:
    workflows, steps, target = size
    return {
        "bench": "runtime",
        "metric": f"{shape}_{kind}_steps_per_s",
        "value": round(statistics.median(rates)),
        "unit": "1/s",
        "target": target,
        "mode": mode,
        "workflows": workflows,
        "steps_each": steps,
        "runs": [round(r) for r in rates],
        "synchronous": "normal",
    }


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
        for shape, (workflows, steps, _) in shapes.items():
            for kind, cls in KINDS.items():
                rates = [
                    await in_process(tmp / f"{shape}-{kind}-{r}.db", cls.name, workflows, steps)
                    for r in range(repeats)
                ]
                figures.append(_figure("in_process", shape, kind, shapes[shape], rates))
    if daemon:
        async with bench_daemon(tmp / "daemon") as d:
            db = d.tmp / "wd.db"
            for shape, (workflows, steps, _) in shapes.items():
                for kind, cls in KINDS.items():
                    rates = [
                        await through_daemon(
                            d.socket, db, f"{shape}-{kind}-{r}", cls.name, workflows, steps
                        )
                        for r in range(repeats)
                    ]
                    figures.append(_figure("workflowd", shape, kind, shapes[shape], rates))
    return figures
