"""Crash torture, the long run: hundreds of workflows, at least 20 SIGKILLs, figures as JSON lines.

Usage: `python -m tests.benchmarks.bench_torture [seed]`; the runner calls `run()`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec

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


async def run(plan: Plan = PLAN) -> list[dict[str, Any]]:
    """Run the long torture in a temporary folder; broken promises go to stderr."""
    with tempfile.TemporaryDirectory(prefix="bench_torture-") as tmp:
        report = await torture(Path(tmp), plan)
    for problem in report.problems:
        print(f"# torture problem: {problem}", file=sys.stderr)
    return figures(report)


async def _main() -> None:
    plan = PLAN
    if len(sys.argv) > 1:
        plan = Plan(**{**vars(PLAN), "seed": int(sys.argv[1])})
    for fig in await run(plan):
        print(msgspec.json.encode(fig).decode(), flush=True)


if __name__ == "__main__":
    anyio.run(_main)
