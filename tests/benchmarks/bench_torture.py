"""Crash torture, the long run: hundreds of workflows, at least 20 SIGKILLs, figures as JSON lines.

Then the disk-full phase: the database's disk (a tmpfs) fills up 20 times while 40 Collectors
are sent values; acknowledged sends lost, applied out of order or stranded, and daemon exits,
must all be 0. Where no tmpfs can be mounted the phase is skipped (a note on stderr says why).

Usage: `python -m tests.benchmarks.bench_torture [seed]`; the runner calls `run()`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec

from tests.helpers.disk_torture import FullPlan, FullReport, disk_full_torture
from tests.helpers.torture import Plan, Report, torture

PLAN = Plan(
    seed=20,
    kills=22,
    graceful_every=6,
    early_every=4,
    kill_gap_s=(0.4, 1.4),
    loopers=150,
    fans=40,
    sleepers=50,
    collectors=40,
    doors=20,
    values=8,
    start_over_s=25.0,
    finish_limit_s=180.0,
)

FULL_PLAN = FullPlan(seed=20, collectors=40, fills=20, finish_limit_s=180.0)


def figures(report: Report) -> list[dict[str, Any]]:
    """Turn a torture report into the runner's figures."""
    rows = [
        ("kills_survived", report.kills, 20),
        ("graceful_restarts", report.graceful, None),
        ("workflows", report.workflows, None),
        ("steps", report.steps, None),
        ("step_runs", report.step_runs, None),
        ("duplicate_step_runs", report.duplicate_runs, None),
        ("failed_step_runs_on_purpose", report.failed_runs, None),
        ("acknowledged_callbacks", report.acked_sends + report.acked_knocks, None),
        ("unacknowledged_sends", report.unacked_sends, None),
        ("problems", len(report.problems), 0),
        ("duration_s", report.seconds, None),
    ]
    return [
        {"bench": "torture", "metric": m, "value": v, "unit": "s" if m.endswith("_s") else "",
         "target": t, "seed": PLAN.seed}
        for m, v, t in rows
    ]  # fmt: skip


def full_figures(report: FullReport, seed: int) -> list[dict[str, Any]]:
    """Turn a disk-full phase report into the runner's figures (none if it was skipped)."""
    if report.skipped:
        return []
    rows = [
        ("disk_full_fills", report.fills, None),
        ("disk_full_acked_sends", report.acked_sends, None),
        ("disk_full_acked_no_wait_sends", report.acked_no_wait, None),
        ("disk_full_refused_sends", report.refused_sends, None),
        ("disk_full_checkpoint_failures", report.checkpoint_failures, None),
        ("disk_full_acked_lost", report.lost, 0),
        ("disk_full_acked_out_of_order", report.out_of_order, 0),
        ("disk_full_acked_stranded", report.stranded, 0),
        ("disk_full_refused_but_applied", report.refused_but_applied, 0),
        ("disk_full_daemon_exits", report.daemon_exits, 0),
        ("disk_full_problems", len(report.problems), 0),
        ("disk_full_duration_s", report.seconds, None),
    ]
    return [
        {"bench": "torture", "metric": m, "value": v, "unit": "s" if m.endswith("_s") else "",
         "target": t, "seed": seed}
        for m, v, t in rows
    ]  # fmt: skip


async def disk_full(full: FullPlan = FULL_PLAN) -> list[dict[str, Any]]:
    """Run the disk-full phase in a temporary folder; broken promises go to stderr."""
    with tempfile.TemporaryDirectory(prefix="bench_torture_full-") as tmp:
        report = await disk_full_torture(Path(tmp), full)
    if report.skipped:
        print(f"# torture disk-full phase skipped: {report.skipped}", file=sys.stderr)
    for problem in report.problems:
        print(f"# torture disk-full problem: {problem}", file=sys.stderr)
    return full_figures(report, full.seed)


async def run(plan: Plan = PLAN, full: FullPlan = FULL_PLAN) -> list[dict[str, Any]]:
    """Run the long torture, then the disk-full phase, in temporary folders."""
    with tempfile.TemporaryDirectory(prefix="bench_torture-") as tmp:
        report = await torture(Path(tmp), plan)
    for problem in report.problems:
        print(f"# torture problem: {problem}", file=sys.stderr)
    return figures(report) + await disk_full(full)


async def _main() -> None:
    plan, full = PLAN, FULL_PLAN
    if len(sys.argv) > 1:
        seed = int(sys.argv[1])
        plan = Plan(**{**vars(PLAN), "seed": seed})
        full = FullPlan(**{**vars(FULL_PLAN), "seed": seed})
    for fig in await run(plan, full):
        print(msgspec.json.encode(fig).decode(), flush=True)


if __name__ == "__main__":
    anyio.run(_main)
