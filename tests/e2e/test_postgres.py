"""Several workflowd processes on one PostgreSQL database: one holds the lease, the others stand by.

Each test gets a database of its own on the session's throwaway cluster (`pg_dsn`).
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from tests.helpers.client import connect
from tests.helpers.harness import REPO, Daemon, run_workflowd, write_config
from tests.helpers.wait import eventually, logged, settled, until, wait_status

MODULES = ["tests.workflows.e2e", "tests.workflows.postgres"]
LEASE_S = 2.0


def node(root: Path, name: str, dsn: str, steplog: Path, lease_s: float = LEASE_S) -> Daemon:
    """Configure (not start) daemon `name` of a group sharing the database at `dsn`."""
    tmp = root / name
    tmp.mkdir()
    store = {"backend": "postgres", "dsn": dsn, "node_id": name, "lease_s": lease_s}
    return Daemon(tmp, write_config(tmp, MODULES, store=store), {"E2E_STEP_LOG": str(steplog)})


async def answers(d: Daemon, limit_s: float) -> float:
    """Wait until `d` answers ping as the lease holder (it recovered every workflow by then,
    a standby answering too); return how long it took."""
    began = time.monotonic()
    with anyio.fail_after(limit_s):
        while True:
            assert d.proc is not None and d.proc.poll() is None, d.output()
            try:
                async with connect(d.socket) as c:
                    pinged = await c.request("ping")
                if pinged["result"]["role"] == "holder":  # not its standby socket, closing
                    return time.monotonic() - began
            except (OSError, KeyError, anyio.EndOfStream, anyio.BrokenResourceError):
                pass  # between the standby's socket and the holder's
            await anyio.sleep(0.02)


async def snapshot(dsn: str) -> tuple[Any, ...]:
    """Return what any write would change: row counts and the newest change of each table."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT (SELECT COUNT(*) FROM workflows), (SELECT MAX(updated_at) FROM workflows),"
            " (SELECT COUNT(*) FROM history), (SELECT MAX(id) FROM history),"
            " (SELECT COUNT(*) FROM inbox), (SELECT MAX(id) FROM inbox),"
            " (SELECT string_agg(id || ':' || status || ':' || data, ',' ORDER BY id)"
            "  FROM workflows)"
        )
        assert row is not None
        return tuple(row)
    finally:
        await conn.close()


async def until_finished(dsn: str, want: int, limit_s: float = 120) -> None:
    """Wait until `want` workflows of the database finished."""
    conn = await asyncpg.connect(dsn)
    sql = "SELECT COUNT(*) FROM workflows WHERE status = 'Finished'"

    async def done() -> bool:
        count: int = await conn.fetchval(sql)
        return count >= want

    try:
        await eventually(done, limit_s)
    finally:
        await conn.close()


async def terminate_connections(dsn: str, name: str = "%") -> None:
    """End the other connections to the database (whose application_name is LIKE `name`),
    as a server restart would."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND application_name LIKE $1",
            name,
        )
    finally:
        await conn.close()


def step_runs(steplog: Path) -> collections.Counter[str]:
    """Count the recorded runs of each (workflow, step)."""
    lines = steplog.read_text().splitlines() if steplog.exists() else []
    return collections.Counter(" ".join(line.split()[:2]) for line in lines)


async def stop_all(*daemons: Daemon) -> None:
    """Stop whatever is still running of the group."""
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            try:
                await d.stop()
            except TimeoutError:
                await d.kill()


class TestStandby:
    async def test_second_daemon_stands_by_until_the_first_stops(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """A second daemon waits without serving; a clean stop of the first hands over at once."""
        steplog = short_tmp / "steps.log"
        # A lease far longer than the wait below: only the release can explain the handover.
        a, b = (node(short_tmp, n, pg_dsn, steplog, lease_s=60) for n in ("a", "b"))
        try:
            await a.start()
            b.spawn()
            (standby,) = await logged(b, "lease_standby")
            assert standby["holder_node"] == "a"
            async with a.client() as c:
                await c.call("start", workflow="Snooze", workflow_id="w", input={"id": "w"})
                pinged = await c.call("ping")
                assert [(n["node_id"], n["role"]) for n in pinged["nodes"]] == [
                    ("a", "holder"), ("b", "standby"),
                ]  # fmt: skip
                assert (await c.call("show", workflow_id="w"))["owner"] == "a"
            await until(lambda: b.socket.exists())
            async with b.client() as c:  # a standby serves what it can read, and says so
                pinged = await c.call("ping")
                assert pinged["role"] == "standby"
                assert [(n["node_id"], n["role"]) for n in pinged["nodes"]] == [
                    ("a", "holder"), ("b", "standby"),
                ]  # fmt: skip
                shown = await c.call("show", workflow_id="w")
                assert shown["owner"] == "a" and shown["data"]["id"] == "w"
                assert [r["workflow_id"] for r in await c.call("list")] == ["w"]
                refused = await c.request("start", workflow="Snooze", workflow_id="x")
                assert refused["error"]["code"] == "unavailable"
                assert "node 'a' runs the workflows" in refused["error"]["message"]
            argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(b.socket), "ping"]
            done = await anyio.run_process(argv, check=False, cwd=REPO)
            assert done.returncode == 0, done.stderr
            assert done.stdout.decode().endswith("; nodes: a (holder), b (standby)\n")
            assert b.proc is not None
            b.proc.send_signal(signal.SIGHUP)  # kept until it holds the lease
            await logged(b, "reload_deferred")
            assert await a.stop() == 0
            await answers(b, limit_s=15)  # released: no lease to wait out
            await logged(b, "reloaded")
            async with b.client() as c:
                shown = await wait_status(c, "w", "Finished")
                assert shown["data"]["runs"] == 1 and shown["owner"] is None  # it ended
                pinged = await c.call("ping")
                assert [(n["node_id"], n["role"]) for n in pinged["nodes"]] == [("b", "holder")]
            assert step_runs(steplog) == {"w work": 1}
        finally:
            await stop_all(a, b)

    async def test_a_standby_stops_cleanly(self, short_tmp: Path, pg_dsn: str) -> None:
        """SIGHUP to a standby is kept for later, SIGTERM ends it with exit 0; the holder goes on."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        try:
            await a.start()
            b.spawn()
            await logged(b, "lease_standby")
            assert b.proc is not None
            b.proc.send_signal(signal.SIGHUP)
            await logged(b, "reload_deferred")
            assert b.proc.poll() is None
            assert await b.stop() == 0
            await logged(b, "daemon_stopping", standby=True)
            async with a.client() as c:
                pinged = await c.call("ping")
            assert [n["role"] for n in pinged["nodes"]] == ["holder"]
        finally:
            await stop_all(a, b)


class TestStart:
    async def test_unreachable_server_exits_2_without_the_password(self, short_tmp: Path) -> None:
        """A server that is not there stops the start: exit 2, one line, no password."""
        store = {"backend": "postgres", "dsn": f"postgresql://wf@/db?host={short_tmp}&port=1"}
        config = write_config(short_tmp, MODULES, store=store)
        env = {**os.environ, "PGPASSWORD": "s3cret"}
        code, stderr = await run_workflowd(config, env=env)
        assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert (
            stderr.startswith("workflowd: cannot open postgresql://wf@/db")
            and "s3cret" not in stderr
        )

    async def test_newer_schema_exits_2(self, short_tmp: Path, pg_dsn: str) -> None:
        """A database from a newer workflowd is refused with one line, exit 2, untouched."""
        d = node(short_tmp, "a", pg_dsn, short_tmp / "steps.log")
        await d.start()
        assert await d.stop() == 0
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute("UPDATE workflowd_schema SET version = version + 5")
        finally:
            await conn.close()
        code, stderr = await run_workflowd(d.config)
        assert code == 2 and "schema version" in stderr and len(stderr.splitlines()) == 1


class TestShared:
    async def test_thousand_workflows_through_one_of_three_finish_once(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """1,000 workflows started through one of three daemons all finish, each step once."""
        steplog = short_tmp / "steps.log"
        group = [node(short_tmp, n, pg_dsn, steplog) for n in ("a", "b", "c")]
        try:
            await group[0].start()
            for d in group[1:]:
                d.spawn()
                await logged(d, "lease_standby")
            async with group[0].client() as c:
                for i in range(1000):
                    await c.call("start", workflow="Steps", workflow_id=f"w{i}",
                                 input={"id": f"w{i}", "n": 2, "delay_s": 0})  # fmt: skip
                await until_finished(pg_dsn, 1000)
                await settled(c)
            runs = step_runs(steplog)
            assert len(runs) == 2000 and set(runs.values()) == {1}
        finally:
            await stop_all(*group)

    async def test_the_server_dropping_every_connection_is_survived(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """The server ending all of the holder's connections mid-run (a restart, a failover of
        the server): writes are retried, the lease is renewed, every workflow finishes."""
        steplog = short_tmp / "steps.log"
        a = node(short_tmp, "a", pg_dsn, steplog)
        try:
            await a.start()
            async with a.client() as c:
                for i in range(20):
                    await c.call("start", workflow="Steps", workflow_id=f"w{i}",
                                 input={"id": f"w{i}", "n": 20, "delay_s": 0.01})  # fmt: skip
                await logged(a, "step_done", count=20)
                await terminate_connections(pg_dsn)
                await until_finished(pg_dsn, 20, limit_s=60)
                assert (await c.call("ping"))["workflows"] == {"Finished": 20}
            assert a.proc is not None and a.proc.poll() is None
            assert not [r for r in a.records() if r.get("event") == "lease_lost"]
        finally:
            await stop_all(a)

    async def test_a_standby_outlives_losing_its_connection(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """The server dropping a standby's connections (a restart) is retried, not fatal."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        try:
            await a.start()
            b.spawn()
            await logged(b, "lease_standby")
            await terminate_connections(pg_dsn, "workflowd b %")
            await logged(b, "lease_standby_retry")
            assert await a.stop() == 0
            await answers(b, limit_s=LEASE_S + 15)
        finally:
            await stop_all(a, b)


class TestTakeover:
    async def test_sigkill_hands_every_workflow_to_the_standby(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """SIGKILL the lease holder mid-run: the standby serves within lease_s + 5 s, finishes
        every workflow, keeps every acknowledged send and re-runs no checkpointed step."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        steps = [f"s{i}" for i in range(20)]
        gates = [f"t{i}" for i in range(10)]
        try:
            await a.start()
            b.spawn()
            await logged(b, "lease_standby")
            async with a.client() as c:
                for wid in steps:
                    await c.call("start", workflow="Steps", workflow_id=wid,
                                 input={"id": wid, "n": 10, "delay_s": 0.03})  # fmt: skip
                for wid in gates:
                    await c.call("start", workflow="Turnstile", workflow_id=wid,
                                 input={"id": wid, "need": 3})  # fmt: skip
                for wid in gates:
                    await wait_status(c, wid, "Waiting")
                    await c.call("send", workflow_id=wid, event="add", input=1)
                    await c.call("send", workflow_id=wid, event="add", input=2, wait=False)
            await a.kill()
            took = await answers(b, limit_s=LEASE_S + 5)
            assert took <= LEASE_S + 5
            async with b.client() as c:
                for wid in gates:
                    await wait_status(c, wid, "Waiting")
                    await c.call("send", workflow_id=wid, event="add", input=3)
                for wid in [*steps, *gates]:
                    await wait_status(c, wid, "Finished", limit_s=30)
                for wid in gates:
                    shown = await c.call("show", workflow_id=wid)
                    assert shown["data"]["got"] == [1, 2, 3]
                for wid in steps:
                    assert (await c.call("show", workflow_id=wid))["data"]["i"] == 10
            runs = step_runs(steplog)
            # A step running at the kill may run again (at least once); no other step may.
            for wid in steps:
                again = [s for s in (f"{wid} s{i}" for i in range(10)) if runs[s] > 1]
                assert len(again) <= 1 and all(runs[s] == 2 for s in again), (wid, again)
            await logged(b, "lease_acquired", node_id="b")
        finally:
            await stop_all(a, b)


class TestPartition:
    async def test_stopped_holder_writes_nothing_after_it_lost_the_lease(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """SIGSTOP the holder past its lease: the standby takes over and finishes its work; on
        SIGCONT the old holder, whose timer is overdue, writes nothing and exits 3."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        try:
            await a.start()
            b.spawn()
            await logged(b, "lease_standby")
            async with a.client() as c:
                await c.call("start", workflow="Snooze", workflow_id="w",
                             input={"id": "w", "delay_s": LEASE_S + 1})  # fmt: skip
                await wait_status(c, "w", "Waiting")
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            try:
                await answers(b, limit_s=LEASE_S + 15)
                async with b.client() as c:
                    shown = await wait_status(c, "w", "Finished")
                    assert shown["data"]["runs"] == 1
                    await settled(c)
                before = await snapshot(pg_dsn)
            finally:
                a.proc.send_signal(signal.SIGCONT)
            # Its timer was due while it was stopped: it fires now, and its checkpoint is fenced.
            await until(lambda: a.proc is not None and a.proc.poll() is not None, LEASE_S + 10)
            assert a.proc.returncode == 3, a.output()
            assert [r for r in a.records() if r.get("event") == "lease_lost"]
            assert await snapshot(pg_dsn) == before
            assert step_runs(steplog)["w work"] >= 1
        finally:
            await stop_all(a, b)
