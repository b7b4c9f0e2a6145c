"""What a log record costs the event loop: queued info records, filtered debug ones, errors."""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from tests.benchmarks.common import production_logging

#: Issue 16: a record costs the loop at most this much (rendering and writing happen elsewhere).
TARGET_US = 3.0
#: Records per loop turn, about what a busy turn of the daemon logs.
PER_TURN = 64


async def _loop_cost(records: int, method: str) -> float:
    """Return the loop thread's CPU µs per record for `records` calls of `method`."""
    log = structlog.get_logger("bench")
    call = getattr(log, method)
    start = time.thread_time()
    with structlog.contextvars.bound_contextvars(workflow_id="wf-1", workflow="Bench"):
        for n in range(records):
            call("step_done", step="tick", duration_ms=0.12)
            if n % PER_TURN == 0:
                await anyio.lowlevel.checkpoint()
    return (time.thread_time() - start) / records * 1e6


async def run(records: int = 50_000) -> list[dict[str, Any]]:
    """Log `records` records of each kind as workflowd does; best of three rounds each."""
    figures = []
    with production_logging(cache=True):
        for metric, method, n, target in (
            ("info_record_loop_us", "info", records, TARGET_US),
            ("filtered_debug_record_loop_us", "debug", records, None),
            ("error_record_us", "error", max(1, records // 10), None),
        ):
            best = min([await _loop_cost(n, method) for _ in range(3)])
            figures.append(
                {"bench": "log", "metric": metric, "value": round(best, 2), "unit": "us"}
                | ({"target": target} if target is not None else {})
            )
    return figures
