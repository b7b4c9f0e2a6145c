"""What a log record costs the event loop: queued info records, filtered debug ones, errors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from daemon.service.log import flush_logs
from tests.benchmarks.common import production_logging

#: Issue 16: a record costs the loop at most this much (rendering and writing happen elsewhere).
TARGET_US = 3.0
#: Records per loop turn, about what a busy turn of the daemon logs.
PER_TURN = 64


async def _cost(records: int, call: Callable[..., Any]) -> tuple[float, float]:
    """Return (loop thread CPU µs, whole process CPU µs) per record for `records` calls.

    The process figure adds the writer thread's rendering and writing, flushed at the end.
    """
    loop_start, all_start = time.thread_time(), time.process_time()
    with structlog.contextvars.bound_contextvars(workflow_id="wf-1", workflow="Bench"):
        for n in range(records):
            call("step_done", step="tick", duration_ms=0.12)
            if n % PER_TURN == 0:
                await anyio.lowlevel.checkpoint()
    loop_us = (time.thread_time() - loop_start) / records * 1e6
    flush_logs()
    return loop_us, (time.process_time() - all_start) / records * 1e6


def _step_done(log: Any) -> Callable[..., Any]:
    """Call `log.info` as daemon/runtime/steps.py does, attribute lookup included."""

    def call(event: str, **kw: Any) -> Any:
        return log.info(event, **kw)

    return call


async def run(records: int = 50_000) -> list[dict[str, Any]]:
    """Log `records` records of each kind as workflowd does; best of three rounds each."""
    figures = []
    with production_logging(cache=True):
        # A module's logger is structlog's lazy proxy: every `log.info` goes through its
        # __getattr__ to the cached bound logger. The first figures call that logger directly.
        proxy = structlog.get_logger("bench")
        for metric, call, n, target in (
            ("info_record_loop_us", proxy.info, records, TARGET_US),
            ("step_done_call_loop_us", _step_done(proxy), records, TARGET_US),
            ("filtered_debug_record_loop_us", proxy.debug, records, None),
            ("error_record_us", proxy.error, max(1, records // 10), None),
        ):
            rounds = [await _cost(n, call) for _ in range(3)]
            best = min(r[0] for r in rounds)
            figures.append(
                {"bench": "log", "metric": metric, "value": round(best, 2), "unit": "us"}
                | ({"target": target} if target is not None else {})
            )
            if metric == "info_record_loop_us":
                # The writer thread's share: it holds the GIL while it renders, so it is
                # not free for the daemon either, only off the loop.
                whole = min(r[1] for r in rounds)
                figures.append(
                    {"bench": "log", "metric": "info_record_cpu_us", "value": round(whole, 2)}
                    | {"unit": "us"}
                )
                # Off the loop alone: merging the context, the timestamp, rendering, the
                # hub and the write, per record (the round's whole CPU less its loop's).
                off = min(r[1] - r[0] for r in rounds)
                figures.append(
                    {"bench": "log", "metric": "info_record_writer_us", "value": round(off, 2)}
                    | {"unit": "us"}
                )
    return figures
