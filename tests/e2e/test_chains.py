"""Runs of a workflow's steps in a real daemon: chained back to back, with every promise kept.

A lone thread's quick steps run as a chain (sync ones in one worker thread, async and inline
ones on the loop) with one checkpoint for the run. These tests check, through a real
workflowd, that each step runs once and where it belongs, a failing one is undone and retried
after the steps before it are durable, and `show` names the step running now.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.harness import running_daemon
from tests.helpers.wait import shown_when, until, wait_status

MODULES = ["tests.workflows.chains"]
STORE = {"synchronous": "full"}


def runs(log: Path) -> Counter[str]:
    """Count how often each step ran."""
    return Counter(line for line in log.read_text().split("\n") if line)


def names(n: int) -> list[str]:
    return [f"s{i}" for i in range(n)]


class TestChains:
    async def test_steps_of_each_kind_run_once_in_order_where_they_belong(
        self, tmp_path: Path
    ) -> None:
        """Sync steps run in worker threads, async and inline ones on the loop, each once."""
        log, n = tmp_path / "steps.log", 30
        async with running_daemon(tmp_path, MODULES, store=STORE) as d, d.client() as c:
            await c.call("start", workflow="KindsInTurn", workflow_id="k", input={
                "n": n, "log": str(log)})  # fmt: skip
            shown = await wait_status(c, "k", "Finished", limit_s=60)
            history = await c.call("history", workflow_id="k")
        assert shown["data"]["ran"] == names(n)
        assert shown["data"]["in_threads"] == [f"s{i}" for i in range(n) if (i // 3) % 3 == 0]
        assert runs(log) == Counter(names(n))
        done = [e["step"] for e in history if e["kind"] == "step_done"]
        assert done == names(n)

    @pytest.mark.parametrize("fail_at", [4, 13, 22])  # a sync, an async and an inline step
    async def test_a_failing_step_is_undone_and_retried_after_the_steps_before_it(
        self, tmp_path: Path, fail_at: int
    ) -> None:
        """Amid a run, the failing step's change is undone; the steps before it are durable
        before its failure is stored, and its retry goes on from there."""
        log, n = tmp_path / "steps.log", 30
        async with running_daemon(tmp_path, MODULES, store=STORE) as d, d.client() as c:
            await c.call("start", workflow="KindsInTurn", workflow_id="f", input={
                "n": n, "log": str(log), "fail_at": fail_at})  # fmt: skip
            shown = await wait_status(c, "f", "Finished", limit_s=60)
            history = await c.call("history", workflow_id="f")
        assert shown["data"]["ran"] == names(n)
        kinds = [e["kind"] for e in history]
        assert kinds.index("step_failed") == kinds.index("started") + fail_at + 1, kinds
        assert kinds.count("step_done") == n and kinds.count("step_failed") == 1
        assert runs(log) == Counter(names(n)) + Counter([f"s{fail_at}"])

    @pytest.mark.sqlite_only("reads the database file")
    async def test_show_names_the_chained_step_running_now(self, tmp_path: Path) -> None:
        """`show` tells the step of a run of sync steps that runs now, and its data so far
        is the last durable checkpoint's: never a half-done step."""
        log, gate, db, n = tmp_path / "steps.log", tmp_path / "gate", tmp_path / "wd.db", 9
        input = {"n": n, "rounds": 100, "log": str(log), "gate": str(gate), "gate_at": 5}
        async with running_daemon(tmp_path, MODULES, store=STORE) as d, d.client() as c:
            await c.call("start", workflow="KindsInTurn", workflow_id="g", input=input)
            await until((tmp_path / "steps.log.entered").exists, limit_s=30)
            shown = await shown_when(c, "g", lambda s: "running_step" in s, limit_s=30)
            assert shown["running_step"]["step"] == "s5"
            assert "running_since" in shown["running_step"]
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
            try:
                (data,) = conn.execute("SELECT data FROM workflows WHERE id = 'g'").fetchone()
            finally:
                conn.close()
            durable = json.loads(data)["ran"]
            assert durable == names(len(durable)) and len(durable) <= 5, durable
            gate.touch()
            shown = await wait_status(c, "g", "Finished", limit_s=60)
        assert shown["data"]["ran"] == names(n)
        assert runs(log) == Counter(names(n))
