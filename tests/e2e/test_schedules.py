"""Schedules in a real `workflowd`: catch-up after downtime, a kill around a fire, overlap,
workflowctl's `schedule` commands, and start and reload refusing bad schedules.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio

from tests.helpers.client import Client
from tests.helpers.harness import REPO, Daemon, run_workflowd, running_daemon, write_config
from tests.helpers.wait import eventually
from tests.workflows.schedules import SCHEDULES_ENV

MODULES = ["tests.workflows.schedules"]
STARTS = ("fired", "caught_up", "manual")


def env_of(*schedules: dict[str, Any]) -> dict[str, str]:
    """Return the daemon environment that gives it these schedules (Schedule keyword args)."""
    return {SCHEDULES_ENV: json.dumps(list(schedules))}


def every_second(name: str, **more: Any) -> dict[str, Any]:
    """A Chime every second; overlap allowed, so only the catch-up policy decides."""
    return {"name": name, "workflow": "Chime", "every": 1, "overlap": "allow", **more}


def nominal_of(workflow_id: str) -> float:
    """Return the nominal time in a scheduled workflow's id (`name:2026-01-02T03:04:05Z`)."""
    stamp = workflow_id.split(":", 1)[1]
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


async def fires(c: Client, name: str) -> list[dict[str, Any]]:
    """Return a schedule's kept fire records, oldest first."""
    shown: dict[str, Any] = await c.call("schedule_show", name=name)
    return list(shown["fires"])


async def started_nominals(c: Client, name: str) -> list[float]:
    """Return the nominal times of the workflows a schedule started (not manual ones)."""
    rows = await c.call("list", workflow="Chime", limit=1000)
    ids = [r["workflow_id"] for r in rows if r["workflow_id"].startswith(f"{name}:")]
    return sorted(nominal_of(w) for w in ids if ":manual:" not in w)


async def wait_fires(c: Client, name: str, *, after: float = 0.0, n: int = 1) -> None:
    """Wait until `name` started `n` workflows whose nominal time is after `after`."""

    async def enough() -> bool:
        return sum(t > after for t in await started_nominals(c, name)) >= n

    await eventually(enough, limit_s=30)


def whole_seconds(lo: float, hi: float) -> list[float]:
    """Return the whole seconds t with lo < t < hi."""
    return [float(t) for t in range(math.floor(lo) + 1, math.ceil(hi))]


async def workflowctl(sock: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run workflowctl against `sock` and return the finished process."""
    argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(sock), *args]
    with anyio.fail_after(30):
        return await anyio.run_process(argv, cwd=REPO, check=False)


def ok(done: subprocess.CompletedProcess[bytes]) -> str:
    """Return stdout of a workflowctl run that succeeded quietly."""
    assert done.returncode == 0 and done.stderr == b"", done.stderr.decode()
    return done.stdout.decode()


class TestCatchUp:
    """A daemon stopped for several intervals catches up by each schedule's policy."""

    async def test_each_policy_after_downtime(self, tmp_path: Path) -> None:
        """skip starts nothing missed, once the newest missed time, all every one of them."""
        env = env_of(
            every_second("skip", catchup="skip"),
            every_second("once", catchup="once"),
            every_second("all", catchup="all"),
        )
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            async with d.client() as c:
                for name in ("skip", "once", "all"):
                    await wait_fires(c, name, n=2)
            await d.stop()
            stopped = time.time()
            # The downtime is the behaviour under test: several intervals pass unwatched.
            await anyio.sleep(3.5)
            restarted = time.time()
            await d.start()
            async with d.client() as c:
                for name in ("skip", "once", "all"):
                    await wait_fires(c, name, after=restarted + 1, n=2)
                got = {name: await started_nominals(c, name) for name in ("skip", "once", "all")}
                records = {name: await fires(c, name) for name in ("skip", "once", "all")}
        last = {name: max(t for t in ns if t < stopped) for name, ns in got.items()}
        for name, ns in got.items():
            missed = whole_seconds(last[name], restarted)
            assert len(missed) >= 3, (name, missed)
            kinds = Counter(r["kind"] for r in records[name])
            if name == "skip":
                assert not set(ns) & set(missed), ns
                assert kinds["caught_up"] == 0
                skips = [r for r in records[name] if r["kind"] == "skipped"]
                assert skips and skips[0]["reason"] == "missed"
                assert skips[0]["count"] >= len(missed)
            elif name == "once":
                (caught,) = [r["nominal_at"] for r in records[name] if r["kind"] == "caught_up"]
                assert caught >= missed[-1]  # the newest missed time (or one missed during start)
                assert not [t for t in ns if last[name] < t < caught]
            else:
                assert ns == [float(t) for t in range(int(ns[0]), int(ns[-1]) + 1)], "a gap"
                assert kinds["caught_up"] >= len(missed)
        # Logged too: a fire as schedule_fired, the given-up times as schedule_skipped.
        events = [(r.get("event"), r.get("schedule")) for r in d.records()]
        assert ("schedule_skipped", "skip") in events and ("schedule_fired", "all") in events


class TestKill:
    """A SIGKILL right around a fire neither loses nor doubles it."""

    async def test_kill_around_fires(self, tmp_path: Path) -> None:
        """Killed at or just after nominal times, each nominal time still has one workflow."""
        env = env_of(every_second("k", catchup="all"))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            for offset in (0.0, 0.002, 0.004, 0.008, 0.02):
                async with d.client() as c:
                    await wait_fires(c, "k", after=time.time())
                # The moment of the kill is the behaviour: just at or after a nominal time,
                # while its start is being written.
                due = math.ceil(time.time()) + offset
                await anyio.sleep(due - time.time())
                await d.kill()
                await d.start()
            async with d.client() as c:
                await wait_fires(c, "k", after=time.time() + 1, n=2)
                await d.stop()
            await d.start()
            async with d.client() as c:
                ns = await started_nominals(c, "k")
                # Read after `ns`, while the schedule goes on firing: a later fire is no part
                # of what is compared (a fire's record and workflow commit together).
                records = [
                    r
                    for r in await fires(c, "k")
                    if r["kind"] in STARTS and r["nominal_at"] <= ns[-1]
                ]
                ids = [f"k:{datetime.fromtimestamp(t, UTC):%Y-%m-%dT%H:%M:%SZ}" for t in ns]
                starts = [
                    sum(h["kind"] == "started" for h in await c.call("history", workflow_id=w))
                    for w in ids
                ]
        assert ns == [float(t) for t in range(int(ns[0]), int(ns[-1]) + 1)], "a fire was lost"
        by_nominal = Counter(r["nominal_at"] for r in records)
        assert set(by_nominal) == set(ns) and set(by_nominal.values()) == {1}, by_nominal
        assert set(starts) == {1}
        logged = Counter(
            r["workflow_id"] for r in d.records() if r.get("event") == "schedule_fired"
        )
        assert max(logged.values()) == 1  # a record can be lost to the kill, never doubled


class TestOverlap:
    """A previous run still going when the next fire comes."""

    async def test_policies(self, tmp_path: Path) -> None:
        """skip records skips, cancel_other cancels, buffer_one starts right after the end."""
        lingers = {"workflow": "Lingers", "every": 1}
        env = env_of(
            {"name": "ov-skip", "overlap": "skip", **lingers},
            {"name": "ov-cancel", "overlap": "cancel_other", **lingers},
            {"name": "ov-buffer", "overlap": "buffer_one", **lingers},
        )
        async with running_daemon(tmp_path, MODULES, env=env) as d, d.client() as c:

            async def kinds(name: str) -> list[str]:
                return [r["kind"] for r in await fires(c, name)]

            async def settled_in() -> bool:
                return (
                    (await kinds("ov-skip")).count("skipped") >= 2
                    and (await kinds("ov-cancel")).count("fired") >= 3
                    and (await kinds("ov-buffer")).count("skipped") >= 1
                )

            await eventually(settled_in, limit_s=30)
            runs = await c.call("list", workflow="Lingers", limit=1000)
            status = {r["workflow_id"]: r["status"] for r in runs}
            skip_runs = [w for w in status if w.startswith("ov-skip:")]
            assert len(skip_runs) == 1 and status[skip_runs[0]] == "Waiting"
            cancel_runs = sorted(w for w in status if w.startswith("ov-cancel:"))
            assert "Cancelled" in {status[w] for w in cancel_runs[:-1]}
            assert sum(status[w] == "Waiting" for w in cancel_runs) <= 1
            shown = await c.call("schedule_show", name="ov-buffer")
            buffered, running = shown["buffered_at"], shown["last_workflow_id"]
            assert buffered is not None and status[running] == "Waiting"
            await c.call("send", workflow_id=running, event="finish", input="test")

            async def released() -> bool:
                return any(
                    r["kind"] == "fired" and r["reason"] == "buffered"
                    for r in await fires(c, "ov-buffer")
                )

            await eventually(released)
            last = (await fires(c, "ov-buffer"))[-1]
            assert last["reason"] == "buffered" and last["nominal_at"] == buffered


class TestWorkflowctl:
    """`workflowctl schedule ...` against the real daemon."""

    async def test_list_pause_resume_trigger_show(self, tmp_path: Path) -> None:
        """Pausing survives a restart; trigger starts one now; resume catches up once."""
        env = env_of(every_second("tick", catchup="once"))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            s = d.socket
            async with d.client() as c:
                await wait_fires(c, "tick")
            table = ok(await workflowctl(s, "schedule", "list")).splitlines()
            assert table[0].split() == [
                "NAME", "WORKFLOW", "SPEC", "TZ", "NEXT", "LAST", "LAST_RESULT", "PAUSED"
            ]  # fmt: skip
            assert table[1].split()[:4] == ["tick", "Chime", "every", "1s"]
            (row,) = json.loads(ok(await workflowctl(s, "--json", "schedule", "list")))
            assert set(row) == {
                "name", "workflow", "spec", "tz", "next_fire_at", "last_fire_at",
                "last_workflow_id", "last_status", "paused",
            }  # fmt: skip
            assert row["next_fire_at"] > row["last_fire_at"] > time.time() - 30
            assert ok(await workflowctl(s, "schedule", "pause", "tick")) == "tick: paused\n"
            async with d.client() as c:
                before = await started_nominals(c, "tick")
                # Nothing may fire in this window: the time passing is what is tested.
                await anyio.sleep(2.5)
                assert await started_nominals(c, "tick") == before
            await d.stop()
            await d.start()
            shown = json.loads(ok(await workflowctl(s, "--json", "schedule", "show", "tick")))
            assert shown["paused"] is True and shown["next_fire_at"] is None
            out = ok(await workflowctl(s, "schedule", "trigger", "tick"))
            manual = out.split(": ")[0]
            assert manual.startswith("tick:manual:") and out.endswith(": Resuming\n")
            async with d.client() as c:

                async def manual_done() -> bool:
                    shown = await c.call("show", workflow_id=manual)
                    return bool(shown["status"] == "Finished")

                await eventually(manual_done)
                assert await started_nominals(c, "tick") == before
            assert ok(await workflowctl(s, "schedule", "resume", "tick")) == "tick: resumed\n"
            async with d.client() as c:
                await wait_fires(c, "tick", after=before[-1], n=2)
                kinds = [r["kind"] for r in await fires(c, "tick")]
            assert kinds.count("caught_up") == 1 and "manual" in kinds
            text = ok(await workflowctl(s, "schedule", "show", "tick"))
            assert "paused:    no" in text and "AT" in text and "caught_up" in text
            missing = await workflowctl(s, "schedule", "show", "nope")
            assert missing.returncode == 1
            assert b"error: not_found: no schedule 'nope'" in missing.stderr
            usage = await workflowctl(s, "schedule", "pause")
            assert usage.returncode == 2


def bad_module(tmp: Path, body: str) -> dict[str, Any]:
    """Write a workflow module `sched_mod` under `tmp`; return the config's [workflows]."""
    (tmp / "sched_mod.py").write_text(f"from daemon import Schedule\n\n{body}\n")
    return {"workflows": {"paths": [str(REPO), str(tmp)], "modules": [*MODULES, "sched_mod"]}}


class TestRefused:
    """A bad schedule refuses the start (exit 2, one line) or the reload, naming it."""

    async def test_start(self, tmp_path: Path) -> None:
        """Unknown workflow type, duplicate name and invalid cron/tz are each named."""
        cases = {
            'a = Schedule("orphan", "Nope", every=5)': "schedule 'orphan': no workflow type 'Nope'",
            'a = Schedule("twin", "Chime", every=5)\nb = Schedule("twin", "Chime", every=9)': (
                "two schedules are named 'twin'"
            ),
            'a = Schedule("odd", "Chime", cron="61 * * * *")': "schedule 'odd': invalid cron",
            'a = Schedule("far", "Chime", cron="* * * * *", tz="Mars/Base")': (
                "schedule 'far': unknown time zone"
            ),
            'a = Schedule("typo", "Chime", every=5, input={"nope": 1})': (
                "schedule 'typo': Chime has no field nope"
            ),
        }
        for body, message in cases.items():
            config = write_config(tmp_path, MODULES, **bad_module(tmp_path, body))
            code, err = await run_workflowd(config, cwd=tmp_path)
            assert code == 2, err
            assert message in err and len(err.strip().splitlines()) == 1, err

    async def test_reload(self, tmp_path: Path) -> None:
        """A reload with a bad schedule changes nothing; a good one adds it."""
        sections = bad_module(tmp_path, 'a = Schedule("first", "Chime", every=3600)')
        d = Daemon(tmp_path, write_config(tmp_path, MODULES, **sections))
        await d.start()
        try:
            bad_module(tmp_path, 'a = Schedule("first", "Nope", every=3600)')
            refused = await workflowctl(d.socket, "--json", "reload")
            assert refused.returncode == 1
            assert (
                "schedule 'first': no workflow type 'Nope'" in json.loads(refused.stdout)["error"]
            )
            async with d.client() as c:
                (row,) = await c.call("schedules")
                assert row["workflow"] == "Chime"
            bad_module(tmp_path, 'a = Schedule("second", "Chime", cron="0 3 * * *")')
            assert (await workflowctl(d.socket, "reload")).returncode == 0
            async with d.client() as c:
                assert [r["name"] for r in await c.call("schedules")] == ["second"]
        finally:
            await d.stop()
