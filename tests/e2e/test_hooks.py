"""Failure and finish hooks through a real daemon: once per ending, across SIGKILL, with timeouts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.client import Client
from tests.helpers.harness import Daemon, running_daemon, write_config
from tests.helpers.wait import eventually, logged, until, wait_status
from tests.workflows.observe import hook_argv

MODULES = ["tests.workflows.observe"]
#: The hook runner's slots (daemon/observe/hooks.py MAX_RUNNING).
SLOTS = 4


def runs(out: Path) -> list[dict[str, Any]]:
    """Return the hook runs HOOK_SCRIPT recorded."""
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines()]


def slow_pids(out: Path) -> list[int]:
    """Return the pids HOOK_SCRIPT's slow runs wrote."""
    pids = Path(f"{out}.pids")
    return [int(p) for p in pids.read_text().split()] if pids.exists() else []


def of(out: Path, workflow_id: str) -> list[dict[str, Any]]:
    """Return the recorded hook runs of one workflow."""
    return [r for r in runs(out) if r["env"]["WORKFLOWD_WORKFLOW_ID"] == workflow_id]


@pytest.fixture
def hook_out(short_tmp: Path) -> Iterator[Path]:
    """The file HOOK_SCRIPT appends to; its slow runs' pids are killed afterwards."""
    out = short_tmp / "hooks.jsonl"
    yield out
    for pid in slow_pids(out):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def recorded_last(c: Client, workflow_id: str, kind: str) -> None:
    """Wait until the workflow's newest history entry is `kind`.

    The runner logs a hook's outcome before its history entry is committed, so the log line
    alone does not mean the entry is readable yet (on PostgreSQL it often is not).
    """

    async def last_is_kind() -> bool:
        rows = await c.call("history", workflow_id=workflow_id)
        return bool(rows) and rows[-1]["kind"] == kind

    await eventually(last_is_kind)


async def test_failure_hook_gets_argv_and_env(short_tmp: Path, hook_out: Path) -> None:
    """on_failure runs once with the placeholders filled and WORKFLOWD_* set, never a shell."""
    hooks = {"on_failure": hook_argv("{workflow}", "{workflow_id}", "{error}", "$HOME;{event}")}
    env = {"HOOK_OUT": str(hook_out)}
    async with running_daemon(short_tmp, MODULES, env, hooks=hooks) as d, d.client() as c:
        await c.call("start", workflow="Doomed", workflow_id="d1", input={"reason": "no $money"})
        await wait_status(c, "d1", "Failed")
        await until(lambda: len(of(hook_out, "d1")) == 1)
        await logged(d, "hook_ran", workflow_id="d1")
        (run,) = of(hook_out, "d1")
        shown = await c.call("show", workflow_id="d1")
        assert shown["error"].endswith("no $money")
        assert run["argv"] == ["Doomed", "d1", shown["error"], "$HOME;failure"]
        assert run["env"]["WORKFLOWD_WORKFLOW"] == "Doomed"
        assert run["env"]["WORKFLOWD_ERROR"] == shown["error"]
        assert run["env"]["WORKFLOWD_STATUS"] == "Failed"
        assert run["env"]["WORKFLOWD_EVENT"] == "failure"
        await recorded_last(c, "d1", "hook_ran")
        # A finished workflow has no on_failure hook (and no on_finish is configured).
        await c.call("start", workflow="Counted", workflow_id="c1")
        await wait_status(c, "c1", "Waiting")
        await c.call("send", workflow_id="c1", event="go")
        await wait_status(c, "c1", "Finished")
        # retry makes a second failure: it has a new key, so it gets its own run
        await c.call("retry", workflow_id="d1")
        await wait_status(c, "d1", "Failed")
        await until(lambda: len(of(hook_out, "d1")) == 2)
    assert of(hook_out, "c1") == []


async def test_finish_hook_and_type_hook(short_tmp: Path, hook_out: Path) -> None:
    """on_finish runs for Finished; a type's own on_failure replaces the [hooks] one."""
    hooks = {"on_failure": hook_argv("global"), "on_finish": hook_argv("done", "{status}")}
    env = {"HOOK_OUT": str(hook_out)}
    async with running_daemon(short_tmp, MODULES, env, hooks=hooks) as d, d.client() as c:
        await c.call("start", workflow="Counted", workflow_id="c1")
        await wait_status(c, "c1", "Waiting")
        await c.call("send", workflow_id="c1", event="go")
        await c.call("start", workflow="SelfHooked", workflow_id="s1")
        await wait_status(c, "s1", "Failed")
        await until(lambda: bool(of(hook_out, "c1") and of(hook_out, "s1")))
        assert [r["argv"] for r in of(hook_out, "c1")] == [["done", "Finished"]]
        assert [r["argv"] for r in of(hook_out, "s1")] == [["own", "SelfHooked", "failure"]]
        assert d.proc is not None


@pytest.mark.sqlite_only("reads the database file")
async def test_endings_without_hooks_are_forgotten_and_a_hook_still_runs(
    short_tmp: Path, hook_out: Path
) -> None:
    """Endings with no hook are gathered and forgotten; a later one with a hook still runs."""
    env = {"HOOK_OUT": str(hook_out)}
    async with running_daemon(short_tmp, MODULES, env) as d, d.client() as c:
        for i in range(20):
            await c.call("start", workflow="Doomed", workflow_id=f"d{i}", input={"reason": "x"})
        for i in range(20):
            await wait_status(c, f"d{i}", "Failed")

        def left() -> int:
            with contextlib.closing(sqlite3.connect(short_tmp / "wd.db")) as db:
                return int(db.execute("SELECT COUNT(*) FROM hook_runs").fetchone()[0])

        await until(lambda: left() == 0)
        await c.call("start", workflow="SelfHooked", workflow_id="s1")
        await wait_status(c, "s1", "Failed")
        await until(lambda: len(of(hook_out, "s1")) == 1)
        await logged(d, "hook_ran", workflow_id="s1")
        await until(lambda: left() == 0)
    assert [r["env"]["WORKFLOWD_WORKFLOW_ID"] for r in runs(hook_out)] == ["s1"]


async def test_exactly_once_across_sigkill(short_tmp: Path, hook_out: Path) -> None:
    """A failure committed but not yet hooked when the daemon is killed is hooked after the
    restart, once; a hook that already ran is not run again; one killed mid-run is not re-run."""
    hooks = {"on_failure": hook_argv("{workflow_id}")}
    config = write_config(short_tmp, MODULES, hooks=hooks)
    d = Daemon(short_tmp, config, {"HOOK_OUT": str(hook_out)})
    await d.start()
    try:
        async with d.client() as c:
            # Fill every hook slot with a hook that hangs, so the next failure's hook waits.
            for i in range(SLOTS):
                await c.call("start", workflow="Doomed", workflow_id=f"slow{i}")
            await until(lambda: len(slow_pids(hook_out)) == SLOTS)
            await c.call("start", workflow="Doomed", workflow_id="target")
            await wait_status(c, "target", "Failed")  # committed, with its hook queued
        assert of(hook_out, "target") == []  # it waits for a slot
        await d.kill()
        for pid in slow_pids(hook_out):  # orphaned by the kill; they must never finish
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await d.start()  # the restart runs it: it was queued, never started
        await until(lambda: len(of(hook_out, "target")) == 1)
        interrupted = await logged(d, "hook_interrupted", count=SLOTS)
        assert {r["workflow_id"] for r in interrupted} == {f"slow{i}" for i in range(SLOTS)}
        await logged(d, "hook_ran", workflow_id="target")
        await d.kill()  # after it ran: never again
        await d.start()
        async with d.client() as c:
            await c.call("start", workflow="Doomed", workflow_id="after")
            await until(lambda: len(of(hook_out, "after")) == 1)
        assert len(of(hook_out, "target")) == 1
        assert all(not of(hook_out, f"slow{i}") for i in range(SLOTS))
    finally:
        if d.proc is not None and d.proc.poll() is None:
            await d.kill()


async def test_hanging_hook_is_killed_at_its_timeout(short_tmp: Path, hook_out: Path) -> None:
    """A hook past `timeout_s` is killed (its process group), logged `hook_failed`; the daemon
    goes on; a hook that exits non-zero is logged the same way and not hooked again."""
    hooks = {"on_failure": hook_argv("{workflow_id}"), "timeout_s": 0.5}
    env = {"HOOK_OUT": str(hook_out)}
    async with running_daemon(short_tmp, MODULES, env, hooks=hooks) as d, d.client() as c:
        await c.call("start", workflow="Doomed", workflow_id="slow-1")
        (failed,) = await logged(d, "hook_failed", workflow_id="slow-1")
        assert "timeout" in failed["error"]
        pid = slow_pids(hook_out)[0]
        await until(lambda: not Path(f"/proc/{pid}").exists())
        assert (await c.call("ping"))["workflows"]["Failed"] == 1
        await recorded_last(c, "slow-1", "hook_failed")


async def test_hook_that_cannot_run_is_logged(short_tmp: Path) -> None:
    """A hook whose program does not exist: `hook_failed` in log and history, the daemon goes on."""
    hooks = {"on_failure": ["/nonexistent/notify", "{workflow_id}"]}
    async with running_daemon(short_tmp, MODULES, hooks=hooks) as d, d.client() as c:
        await c.call("start", workflow="Doomed", workflow_id="d2")
        (failed,) = await logged(d, "hook_failed", workflow_id="d2")
        assert "nonexistent" in failed["error"]
        await c.call("start", workflow="Doomed", workflow_id="d3")
        await logged(d, "hook_failed", workflow_id="d3")
        await recorded_last(c, "d2", "hook_failed")
        history = await c.call("history", workflow_id="d2")
        assert [h["kind"] for h in history].count("hook_failed") == 1


async def test_bad_hook_template_stops_the_start(short_tmp: Path) -> None:
    """An unknown placeholder is a config error naming the key (exit 2)."""
    from tests.helpers.harness import run_workflowd

    config = write_config(short_tmp, MODULES, hooks={"on_failure": ["/bin/true", "{nope}"]})
    code, err = await run_workflowd(config)
    assert code == 2
    assert "[hooks] on_failure" in err and "{nope}" in err
