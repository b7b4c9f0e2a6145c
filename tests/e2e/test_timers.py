"""Timers in a real workflowd: what a fired timer costs in commits, and recovery of sleepers."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import anyio
import pytest

from tests.helpers.harness import Daemon, running_daemon
from tests.helpers.http import writes_committed
from tests.helpers.wait import logged, settled, until, wait_status

MODULES = ["tests.workflows.timers"]


async def test_a_fired_timer_and_its_rearm_are_one_write(short_tmp: Path) -> None:
    """A timer that fires and re-arms the next one costs one write, not one for each."""
    address = str(short_tmp / "metrics.sock")
    workflows, beats = 10, 10
    async with (
        running_daemon(short_tmp, MODULES, metrics={"listen": address}) as d,
        d.client() as c,
    ):
        before = await writes_committed(address)
        for i in range(workflows):
            await c.call("start", workflow="Metronome", workflow_id=f"m{i}", input={"beats": beats})
        for i in range(workflows):
            await wait_status(c, f"m{i}", "Finished", limit_s=30)
        await settled(c)
        shown = await c.call("show", workflow_id="m0")
        assert shown["data"]["ticked"] == beats
        writes = await writes_committed(address) - before
    # Per workflow: its start, the settle that arms the first timer, then one per beat (the
    # last beat's write is its end). Before, each beat wrote twice: callback, then re-arm.
    per_workflow = writes / workflows
    assert per_workflow <= beats + 3, f"{per_workflow} writes per workflow of {beats} beats"


#: The template sleeper's deadline (2100-01-01), written in its data and its timer's setup.
FAR = 4102444800.0


def _seed(db: Path, template: str, rows: list[tuple[str, float]]) -> None:
    """Copy the template workflow's row once per (id, deadline), as the daemon would store it."""
    with sqlite3.connect(db) as conn:
        cols = "name, status, data, state, error, attempt, next_run_at, created_at, updated_at"
        name, status, data, state, *rest = conn.execute(
            f"SELECT {cols} FROM workflows WHERE id = ?", (template,)
        ).fetchone()
        assert repr(FAR) in data and repr(FAR) in state
        conn.executemany(
            f"INSERT INTO workflows (id, {cols}, history_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
            [
                (wid, name, status, data.replace(repr(FAR), repr(at)),
                 state.replace(template, wid).replace(repr(FAR), repr(at)), *rest)
                for wid, at in rows
            ],
        )  # fmt: skip
    conn.close()


@pytest.mark.sqlite_only("seeds the SQLite file directly")
async def test_sleepers_recovered_lean_fire_once_never_early_across_a_kill(
    short_tmp: Path,
) -> None:
    """Past the first 10,000 sleepers, timers armed from the stored state fire once, on time.

    Some fire, then the daemon is killed (SIGKILL) and restarted: each timer has fired once.
    """
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call("start", workflow="Dozer", workflow_id="template", input={"at": FAR})
        await wait_status(c, "template", "Waiting")
    due = time.time() + 3.0
    soon = [(f"s{i:02d}", due + i * 0.05) for i in range(40)]
    # Ids sorting before the soon ones, so that these are the ones checked in full at start.
    far = [(f"f{i:05d}", FAR) for i in range(10_000)]
    _seed(short_tmp / "wd.db", "template", far + soon)
    d = Daemon(short_tmp, short_tmp / "config.toml")
    try:
        await d.start()
        recovered = (await logged(d, "recovered"))[-1]
        assert recovered["armed"] == 10_041 and recovered["unchecked"] >= 40
        async with d.client() as c:
            await wait_status(c, "s10", "Finished", limit_s=30)
        await d.kill()
        await d.start()
        async with d.client() as c:
            for wid, at in soon:
                shown = await wait_status(c, wid, "Finished", limit_s=30)
                data = shown["data"]
                assert data["rang"] == 1, (wid, data)
                assert data["fired_at"] >= at and data["woke_at"] >= at, (wid, at, data)
            await logged(d, "recovery_checked", limit_s=60)
            ping = await c.call("ping")
            assert ping["workflows"] == {"Waiting": 10_001, "Finished": 40}
    finally:
        if d.proc is not None and d.proc.poll() is None:
            await d.stop()


async def test_a_burst_due_at_one_instant_fires_each_once_never_early_across_a_kill(
    short_tmp: Path,
) -> None:
    """Hundreds of timers due at the same moment fire in one hand-over: each once, none early.

    The daemon is killed (SIGKILL) as soon as the first of them has woken, while the rest of
    the burst may still be committing; after the restart every timer has fired exactly once
    (a fire whose commit was lost fires again, once), and the metronomes re-armed by their own
    callbacks meanwhile have ticked every beat.
    """
    n, beats = 300, 8
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        due = time.time() + 3.0
        for i in range(n):
            await c.call("start", workflow="Dozer", workflow_id=f"d{i:03d}", input={"at": due})
        for i in range(5):
            input = {"beats": beats, "every_s": 0.01}
            await c.call("start", workflow="Metronome", workflow_id=f"m{i}", input=input)
        assert time.time() < due, "the starts took longer than the lead: raise it"
        await wait_status(c, "d000", "Finished", limit_s=30)
        await d.kill()
        await d.start()
        async with d.client() as c2:
            for i in range(n):
                data = (await wait_status(c2, f"d{i:03d}", "Finished", limit_s=30))["data"]
                assert data["rang"] == 1, (i, data)
                assert data["fired_at"] >= due and data["woke_at"] >= due, (i, due, data)
            for i in range(5):
                shown = await wait_status(c2, f"m{i}", "Finished", limit_s=30)
                assert shown["data"]["ticked"] == beats
            await settled(c2)
            ping = await c2.call("ping")
            assert ping["workflows"] == {"Finished": n + 5}


async def test_a_burst_due_at_one_instant_leaves_the_socket_answered(short_tmp: Path) -> None:
    """3,000 timers due at one instant: pings sent meanwhile are answered as they go.

    The timers are handed over in batches with a loop turn between them, so a ping waits for
    a batch, not for all 3,000 workflows' first turns (before, one wake held them all).
    """
    n, clients = 3000, 8
    async with running_daemon(short_tmp, MODULES) as d:
        due = time.time() + 10.0

        async def start(k: int) -> None:
            async with d.client() as c:
                for i in range(k, n, clients):
                    input = {"at": due}
                    await c.call("start", workflow="Dozer", workflow_id=f"b{i:04d}", input=input)

        async with anyio.create_task_group() as tg:
            for k in range(clients):
                tg.start_soon(start, k)
        assert time.time() < due - 1, "the starts took longer than the lead: raise it"
        pings: list[tuple[float, float]] = []
        async with d.client() as c:
            await anyio.sleep(max(0.0, due - 0.2 - time.time()))  # a window, not a wait
            with anyio.fail_after(120):
                while True:
                    sent = time.perf_counter()
                    ping = await c.call("ping")
                    pings.append((time.time(), time.perf_counter() - sent))
                    if ping["workflows"].get("Finished", 0) == n:
                        break
            woke = 0.0
            for i in range(0, n, 97):
                shown = await c.call("show", workflow_id=f"b{i:04d}")
                woke = max(woke, shown["data"]["woke_at"])
    burst_s = woke - due
    longest = max(s for at, s in pings if at >= due)
    # Measured: the longest ping took ~1/3 of the burst (before: longer than the whole burst).
    assert longest < burst_s / 2, (longest, burst_s, len(pings))


def _lines(path: Path) -> int:
    """Count the lines of a file."""
    return len(path.read_text().splitlines())


async def test_a_slow_steps_checkpoint_is_written_while_quick_fires_take_theirs(
    short_tmp: Path,
) -> None:
    """A fired timer's slow step is durable as started while the quick fires around it end.

    The checkpoint a step's start takes is held back a moment (a quick step's end merges into
    it); most holds end early that way, and a hold that ended early is withdrawn. The slow
    step's hold must still end on time: its workflow's row says the step runs while it does.
    After a SIGKILL the step runs again (it was not done), and every quick fire counted once.
    """
    n, gate = 200, short_tmp / "gate"
    db = short_tmp / "wd.db"
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        due = time.time() + 2.0
        for i in range(n):
            input = {"at": due + i / n}  # a second of quick fires, one every 5 ms
            await c.call("start", workflow="Dozer", workflow_id=f"d{i:03d}", input=input)
        slow = {"at": due + 0.5, "gate": str(gate)}
        await c.call("start", workflow="SlowWaker", workflow_id="slow", input=slow)
        assert time.time() < due, "the starts took longer than the lead: raise it"
        runs = Path(f"{gate}.runs")
        await until(runs.exists, limit_s=30)

        def step_durable() -> bool:
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
            try:
                (state,) = conn.execute("SELECT state FROM workflows WHERE id = 'slow'").fetchone()
            finally:
                conn.close()
            threads = json.loads(state)["threads"]
            return any(t["status"] == "Executing" and t["cur_step"] == "gate" for t in threads)

        await until(step_durable, limit_s=30)  # the gate is shut: the step is still running
        assert _lines(runs) == 1
        await wait_status(c, f"d{n - 1:03d}", "Finished", limit_s=30)
        await d.kill()
        gate.touch()
        await d.start()
        async with d.client() as c2:
            shown = await wait_status(c2, "slow", "Finished", limit_s=30)
            assert shown["data"]["opened"] is True
            for i in range(n):
                data = (await wait_status(c2, f"d{i:03d}", "Finished", limit_s=30))["data"]
                assert data["rang"] == 1, (i, data)
    assert _lines(runs) == 2
