"""Run the registered benchmarks and print one JSON line per figure.

Usage: `python -m tests.benchmarks.run [name ...]` (a name is `bench_engine` or just `engine`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

#: One entry per benchmark: "module" (calls its `run`) or "module:function".
#: The function may be sync or async, may take one argument (a fresh temporary directory),
#: and returns one figure (a dict) or a list of them.
BENCHMARKS: list[str] = [
    "bench_engine",
    "bench_store:bench_group_commit",
    "bench_runtime",
    "bench_control",
    "bench_control:control_layer",
    "bench_timers",
    "bench_floor",
    "bench_schedules",
    "bench_postgres",
    "bench_torture",
    "bench_fuzz",
    "bench_log",
    "bench_metrics",
    "bench_fanout",
    "bench_dbos",
]

KEYS = ("bench", "metric", "value", "unit", "target")


def module_of(entry: str) -> str:
    """Return the module name of a registry entry."""
    return entry.partition(":")[0]


def select(entries: Sequence[str], names: Sequence[str]) -> list[str]:
    """Keep the entries whose module matches one of `names` (all when `names` is empty)."""
    if not names:
        return list(entries)
    wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in names}
    unknown = wanted - {module_of(e) for e in entries}
    if unknown:
        raise SystemExit(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    return [e for e in entries if module_of(e) in wanted]


_UNITS = (("_per_s", "1/s"), ("_us", "us"), ("_ms", "ms"), ("_s", "s"))


def _unit(metric: str) -> str:
    return next((unit for suffix, unit in _UNITS if metric.endswith(suffix)), "")


def _split_flat(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn {"bench": b, "x_per_s": 1, "mode": "m"} into one figure per number, text kept as context."""
    numbers = {
        k: v for k, v in fig.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    context = {k: v for k, v in fig.items() if k not in numbers and k != "bench"}
    return [
        {"metric": k, "value": v, "unit": _unit(k), **context}
        | ({"bench": fig["bench"]} if "bench" in fig else {})
        for k, v in numbers.items()
    ]


def normalize(
    entry: str, result: dict[str, Any] | Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Turn what a benchmark returned into figures that start with the runner's keys.

    A figure is {"bench", "metric", "value", "unit", "target"} plus any context keys; a dict
    without "metric" is a flat record whose every number is a figure (as bench_store returns).
    """
    figures = [result] if isinstance(result, dict) else list(result)
    out = []
    for fig in figures:
        for one in [fig] if "metric" in fig else _split_flat(fig):
            row = {"bench": module_of(entry).removeprefix("bench_"), "unit": "", "target": None}
            row |= one
            if "value" not in row:
                raise ValueError(f"{entry}: figure {fig!r} has no 'value'")
            out.append({k: row[k] for k in KEYS} | {k: v for k, v in row.items() if k not in KEYS})
    return out


async def run_entry(entry: str) -> list[dict[str, Any]] | None:
    """Run one benchmark; None when its module does not exist (yet)."""
    module_name, _, func_name = entry.partition(":")
    qualified = f"{__package__ or 'tests.benchmarks'}.{module_name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as e:
        if e.name != qualified:
            raise  # the module exists but one of its imports does not: that is a real error
        return None
    func = getattr(module, func_name or "run")
    with tempfile.TemporaryDirectory(prefix=f"{module_name}-") as tmp:
        params = inspect.signature(func).parameters.values()
        args = [Path(tmp)] if any(p.default is p.empty for p in params) else []
        result = func(*args)
        if inspect.isawaitable(result):
            result = await result
    return normalize(entry, result)


def _cause(e: BaseException) -> str:
    """Name the error inside a task group's group of one, which says nothing by itself."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


async def main(names: Sequence[str]) -> int:
    """Run the selected benchmarks in order; return the exit status."""
    status = 0
    for entry in select(BENCHMARKS, names):
        start = time.perf_counter()
        try:
            figures = await run_entry(entry)
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others
            print(f"# {entry}: failed: {_cause(e)}", file=sys.stderr)
            traceback.print_exception(e, file=sys.stderr)
            status = 1
            continue
        if figures is None:
            print(f"# {entry}: skipped (module not written yet)", file=sys.stderr)
            continue
        for fig in figures:
            print(msgspec.json.encode(fig).decode(), flush=True)
        print(f"# {entry}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(anyio.run(main, sys.argv[1:]))
