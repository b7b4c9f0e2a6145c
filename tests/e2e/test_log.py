"""The log of a real `workflowd`: each record's JSON line, and no record lost on a clean stop."""

from __future__ import annotations

import collections
import re
from pathlib import Path

from tests.helpers.harness import running_daemon
from tests.helpers.wait import logged, until, wait_status

MODULES = ["tests.workflows.e2e"]
#: TimeStamper(fmt="iso", utc=True): microseconds unless they are zero, then Z.
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z")


class TestLines:
    """What an operator's jq and journald see."""

    async def test_step_done_line(self, tmp_path: Path) -> None:
        """A step_done line holds the step, its duration, the event, the workflow, the time and
        the level, in that order, one JSON object per line."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            input = {"id": "w1", "n": 3, "delay_s": 0}
            await c.call("start", workflow="Steps", workflow_id="w1", input=input)
            await wait_status(c, "w1", "Finished")
            done = await logged(d, "step_done", count=3, workflow_id="w1")
        assert len(done) == 3
        for record in done:
            keys = list(record)
            assert keys[:3] == ["step", "duration_ms", "event"], record
            # contextvars come in the order structlog's merge finds them: not fixed
            assert sorted(keys[3:-2]) == ["workflow", "workflow_id"], record
            assert keys[-2:] == ["timestamp", "level"], record
            assert record["step"] == "work" and record["workflow"] == "Steps"
            assert record["level"] == "info" and isinstance(record["duration_ms"], float)
            assert ISO_UTC.fullmatch(record["timestamp"]), record
        stamps = [r["timestamp"] for r in done]  # one workflow's steps, one after the other
        assert stamps == sorted(stamps)  # written in the order they were logged


class TestNothingLost:
    """Records queued for the writer thread still reach stdout."""

    async def test_clean_stop_writes_every_record(self, tmp_path: Path) -> None:
        """SIGTERM mid-run: every step that ran has its step_done line, and the stop is last."""
        steplog = tmp_path / "steps.log"
        env = {"E2E_STEP_LOG": str(steplog)}
        ids = [f"w{n}" for n in range(4)]
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            async with d.client() as c:
                for wid in ids:
                    input = {"id": wid, "n": 100_000, "delay_s": 0.0005}
                    await c.call("start", workflow="Steps", workflow_id=wid, input=input)
            # Stop while steps run and records are queued: once a few hundred steps ran.
            await until(lambda: steplog.exists() and len(steplog.read_bytes().splitlines()) > 400)
            assert await d.stop() == 0
        # A graceful stop lets running steps finish: each step that began logged step_done.
        began = collections.Counter(line.split()[0] for line in steplog.read_text().splitlines())
        records = d.records()
        done = collections.Counter(r["workflow_id"] for r in records if r["event"] == "step_done")
        assert done == began
        assert records[-1]["event"] == "daemon_stopped", records[-3:]


class TestOddValues:
    """Workflow code may log a value whose __str__ raises: that costs the log nothing."""

    async def test_a_value_without_text_is_shown_as_a_placeholder(self, tmp_path: Path) -> None:
        """Its record is written with a placeholder, the records around it too, and the step
        that logged it (async on the loop, or sync in a worker thread) carries on."""
        async with running_daemon(tmp_path, ["tests.workflows.logvalues"]) as d, d.client() as c:
            for kind in ("Async", "Sync"):
                wid = f"odd-{kind.lower()}"
                await c.call("start", workflow=f"OddLog{kind}", workflow_id=wid, input={})
                await wait_status(c, wid, "Finished")
            odd = await logged(d, "odd_value", count=2)
            await logged(d, "after_odd", workflow_id="odd-async")
            steps = await logged(d, "step_done", count=3)
        assert sorted(r["note"] for r in odd) == ["async", "sync"]
        assert {r["value"] for r in odd} == {"<Unprintable: str() failed>"}
        assert {(r["workflow_id"], r["step"]) for r in steps} >= {
            ("odd-async", "odd"), ("odd-async", "after"), ("odd-sync", "odd"),
        }  # fmt: skip
