"""Timers in a real workflowd: what a fired timer costs in commits, and recovery of sleepers."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.harness import running_daemon
from tests.helpers.http import fetch
from tests.helpers.wait import settled, wait_status

MODULES = ["tests.workflows.timers"]


async def _writes(address: str) -> float:
    """Return how many writes the daemon has committed so far (from `/metrics`)."""
    reply = await fetch(address, "/metrics")
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            if s.name == "workflowd_commit_batch_size_sum":
                return float(s.value)
    raise AssertionError("no workflowd_commit_batch_size_sum in /metrics")


async def test_a_fired_timer_and_its_rearm_are_one_write(short_tmp: Path) -> None:
    """A timer that fires and re-arms the next one costs one write, not one for each."""
    address = str(short_tmp / "metrics.sock")
    workflows, beats = 10, 10
    async with (
        running_daemon(short_tmp, MODULES, metrics={"listen": address}) as d,
        d.client() as c,
    ):
        before = await _writes(address)
        for i in range(workflows):
            await c.call("start", workflow="Metronome", workflow_id=f"m{i}", input={"beats": beats})
        for i in range(workflows):
            await wait_status(c, f"m{i}", "Finished", limit_s=30)
        await settled(c)
        shown = await c.call("show", workflow_id="m0")
        assert shown["data"]["ticked"] == beats
        writes = await _writes(address) - before
    # Per workflow: its start, the settle that arms the first timer, then one per beat (the
    # last beat's write is its end). Before, each beat wrote twice: callback, then re-arm.
    per_workflow = writes / workflows
    assert per_workflow <= beats + 3, f"{per_workflow} writes per workflow of {beats} beats"
