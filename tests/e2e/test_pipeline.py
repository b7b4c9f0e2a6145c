"""Pipelined checkpoints in a real daemon: a kill or a failing write loses no acknowledged event.

A workflow's next step runs while its previous checkpoint commits. These tests check the
promises that must survive that: a crash re-runs only steps after the last durable checkpoint,
and nothing that was not durable is acknowledged (a failing write in the middle of a pipeline
answers no send, and the workflow goes back to its durable state).
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest

from daemon.runtime.pipeline import AHEAD
from tests.helpers.client import Client
from tests.helpers.disk import hold_write_lock
from tests.helpers.harness import Daemon, running_daemon
from tests.helpers.wait import logged, until, wait_status

MODULES = ["tests.workflows.pipeline"]
pytestmark = pytest.mark.sqlite_only("reads and locks the database file")


class Ticks:
    """Sends `tick` 0, 1, 2, ... to a PipeTicker, each once it is acknowledged; notes when."""

    def __init__(self) -> None:
        #: Acknowledged inputs, with the time (monotonic) of their answer.
        self.acked: list[tuple[int, float]] = []

    @property
    def values(self) -> list[int]:
        """Return the acknowledged inputs, in order."""
        return [k for k, _ in self.acked]

    async def drive(self, c: Client, workflow_id: str) -> None:
        """Send ticks until the workflow has finished (a kill ends it with an OSError)."""
        while True:
            k = len(self.acked)
            r = await c.request("send", workflow_id=workflow_id, event="tick", input=k)
            if r["ok"]:
                self.acked.append((k, time.monotonic()))
            elif "Finished" in r["error"]["message"]:
                return
            else:
                # Not waiting for a tick now (running steps), or the store is failing: the
                # send may be repeated, as any client would after an error.
                await anyio.sleep(0.005)


def durable(db: Path, workflow_id: str) -> dict[str, object]:
    """Return the workflow's data as committed in the database file."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        (data,) = conn.execute("SELECT data FROM workflows WHERE id = ?", (workflow_id,)).fetchone()
    finally:
        conn.close()
    loaded: dict[str, object] = json.loads(data)
    return loaded


def runs(log: Path) -> Counter[int]:
    """Count how often each step index ran (a line cut short by a kill does not count)."""
    return Counter(int(line) for line in log.read_text().split("\n")[:-1] if line)


def check_runs(counts: Counter[int], n: int, durable_i: int) -> None:
    """Every step ran; those durable at the crash never again; few after it ran twice."""
    assert set(counts) == set(range(n))
    assert [j for j in range(durable_i) if counts[j] != 1] == []
    again = sorted(j for j, times in counts.items() if times > 1)
    assert all(j >= durable_i for j in again), (durable_i, again)
    # One write in flight and one queued, each standing for at most AHEAD checkpoints, and
    # the step that was running.
    assert len(again) <= 2 * AHEAD + 1, (durable_i, again)


def check_ticks(d: Daemon, shown: dict[str, object], ticks: Ticks) -> None:
    """Every acknowledged tick was applied, once and in order (an unanswered one may be too)."""
    data = shown["data"]
    assert isinstance(data, dict)
    applied = data["ticks"]
    assert applied == sorted(set(applied)), applied
    assert set(ticks.values) <= set(applied), (ticks.values, applied)


class TestKill:
    """A SIGKILL in the middle of a pipelined run."""

    async def test_reruns_only_steps_after_the_durable_checkpoint(self, tmp_path: Path) -> None:
        """Steps durable at the kill never run again; every acknowledged tick survives."""
        log, db, n = tmp_path / "steps.log", tmp_path / "wd.db", 3000
        input = {"n": n, "every": 500, "log": str(log)}
        ticks = Ticks()
        store = {"synchronous": "full"}
        async with running_daemon(tmp_path, MODULES, store=store) as d:
            async with d.client() as c:
                await c.call("start", workflow="PipeTicker", workflow_id="t", input=input)
                async with anyio.create_task_group() as tg:

                    async def drive() -> None:
                        try:
                            await ticks.drive(c, "t")
                        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError):
                            return  # the kill closed the connection

                    tg.start_soon(drive)
                    # Past the second tick, amid steps: not while the workflow waits for one.
                    await until(lambda: log.exists() and len(runs(log)) >= 1100, limit_s=60)
                    await until(lambda: len(ticks.acked) >= 2, limit_s=60)
                    await d.kill()
            durable_i = durable(db, "t")["i"]
            assert isinstance(durable_i, int) and 0 < durable_i < n
            await d.start()
            async with d.client() as c:
                await ticks.drive(c, "t")
                shown = await wait_status(c, "t", "Finished", limit_s=60)
        check_runs(runs(log), n, durable_i)
        check_ticks(d, shown, ticks)


class TestFailingWrite:
    """A write that fails (the database locked by another program) in the middle of a pipeline."""

    async def test_acknowledges_nothing_undurable(self, tmp_path: Path) -> None:
        """While nothing can commit, no tick is acknowledged; afterwards all goes on in order."""
        log, db, n = tmp_path / "steps.log", tmp_path / "wd.db", 2000
        input = {"n": n, "every": 100, "log": str(log)}
        ticks = Ticks()
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="PipeTicker", workflow_id="t", input=input)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticks.drive, c, "t")
                await until(lambda: log.exists() and len(runs(log)) >= 300, limit_s=60)
                lock = await anyio.to_thread.run_sync(hold_write_lock, db, "IMMEDIATE")
                try:
                    await logged(d, "checkpoint_failed", 1, limit_s=60, workflow_id="t")
                    # From the first failure on, every write fails until the lock goes.
                    failing_since = time.monotonic()
                    durable_i = durable(db, "t")["i"]
                    await logged(d, "checkpoint_failed", 2, limit_s=60, workflow_id="t")
                    assert durable(db, "t")["i"] == durable_i  # the lock really holds
                    released = time.monotonic()
                finally:
                    lock.close()  # a rollback: the daemon's retry succeeds
            shown = await wait_status(c, "t", "Finished", limit_s=60)
            assert d.proc is not None and d.proc.poll() is None
        acked_meanwhile = [k for k, at in ticks.acked if failing_since <= at <= released]
        assert acked_meanwhile == []
        assert isinstance(durable_i, int)
        check_runs(runs(log), n, durable_i)
        check_ticks(d, shown, ticks)


class TestRunsOfSyncSteps:
    """A workflow's sync steps run back to back in one worker thread, with the same promises."""

    async def test_a_stop_finishes_the_running_step_and_starts_no_next(
        self, tmp_path: Path
    ) -> None:
        """SIGTERM amid a run of sync steps: the running one ends and is durable, no step after
        it runs, and after a restart every step has run exactly once."""
        log, gate, db, n = tmp_path / "steps.log", tmp_path / "gate", tmp_path / "wd.db", 200
        input = {"n": n, "log": str(log), "gate": str(gate), "gate_at": 50}
        async with running_daemon(tmp_path, MODULES, store={"synchronous": "full"}) as d:
            async with d.client() as c:
                await c.call("start", workflow="GatedRun", workflow_id="g", input=input)
            entered = tmp_path / "steps.log.entered"
            await until(entered.exists, limit_s=30)
            assert d.proc is not None
            d.proc.send_signal(signal.SIGTERM)
            await logged(d, "daemon_stopping", limit_s=30)
            gate.touch()
            proc = d.proc
            await until(lambda: proc.poll() is not None, limit_s=30)
            assert proc.returncode == 0
            assert durable(db, "g")["i"] == 51
            assert runs(log) == Counter(range(51))
            await d.start()
            async with d.client() as c:
                await wait_status(c, "g", "Finished", limit_s=60)
        assert runs(log) == Counter(range(n))

    async def test_a_failed_step_finds_the_steps_before_it_durable(self, tmp_path: Path) -> None:
        """When a step fails after a run of steps, their checkpoint commits before its failure
        is stored; its retry then goes on from there."""
        log, n = tmp_path / "steps.log", 100
        input = {"n": n, "log": str(log), "fail_at": 40}
        store = {"synchronous": "full"}
        async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
            await c.call("start", workflow="GatedRun", workflow_id="f", input=input)
            shown = await wait_status(c, "f", "Finished", limit_s=60)
            history = await c.call("history", workflow_id="f")
        kinds = [e["kind"] for e in history]
        # The failure is stored after the 40 steps before it, and the retry's step after it.
        assert kinds.index("step_failed") == kinds.index("started") + 41, kinds[:50]
        assert kinds.count("step_done") == n and kinds.count("step_failed") == 1
        assert next(e for e in history if e["kind"] == "step_failed")["attempt"] == 1
        assert shown["data"]["i"] == n
        assert runs(log) == Counter(range(n))
