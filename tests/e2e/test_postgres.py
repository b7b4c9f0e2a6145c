"""Several workflowd processes on one PostgreSQL database, sharing the work by per-workflow leases.

Each test gets a database of its own on the session's throwaway cluster (`pg_dsn`).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from tests.helpers.client import connect
from tests.helpers.harness import REPO, Daemon, run_workflowd, write_config
from tests.helpers.wait import eventually, logged, settled, wait_status
from tests.workflows.schedules import SCHEDULES_ENV

MODULES = ["tests.workflows.e2e", "tests.workflows.postgres"]
LEASE_S = 2.0


def node(
    root: Path,
    name: str,
    dsn: str,
    steplog: Path,
    lease_s: float = LEASE_S,
    env: dict[str, str] | None = None,
    **more: Any,
) -> Daemon:
    """Configure (not start) daemon `name` of a group sharing the database at `dsn`."""
    tmp = root / name
    tmp.mkdir(exist_ok=True)
    store = {"backend": "postgres", "dsn": dsn, "node_id": name, "lease_s": lease_s, **more}
    modules = [*MODULES, "tests.workflows.schedules"] if env else MODULES
    config = write_config(tmp, modules, store=store)
    return Daemon(tmp, config, {"E2E_STEP_LOG": str(steplog), **(env or {})})


async def answers(d: Daemon, limit_s: float) -> float:
    """Wait until `d` answers ping; return how long it took."""
    began = time.monotonic()
    with anyio.fail_after(limit_s):
        while True:
            assert d.proc is not None and d.proc.poll() is None, d.output()
            try:
                async with connect(d.socket) as c:
                    await c.request("ping")
                return time.monotonic() - began
            except (OSError, KeyError, anyio.EndOfStream, anyio.BrokenResourceError):
                pass
            await anyio.sleep(0.02)


async def query(dsn: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Run one query on a connection of its own."""
    conn = await asyncpg.connect(dsn)
    try:
        return [tuple(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


async def owners(dsn: str) -> collections.Counter[str]:
    """Count the workflows by the node that owns (or last owned) each: `owner` names it."""
    rows = await query(dsn, "SELECT split_part(owner, ' ', 2) FROM workflows")
    return collections.Counter(r[0] for r in rows)


async def until_value(dsn: str, sql: str, want: Any, *args: Any, limit_s: float = 15) -> None:
    """Wait until the one-value query `sql` returns `want` (on one connection throughout)."""
    conn = await asyncpg.connect(dsn)

    async def there() -> bool:
        return bool(await conn.fetchval(sql, *args) == want)

    try:
        await eventually(there, limit_s)
    finally:
        await conn.close()


async def held_by(dsn: str, wid: str, node_id: str, limit_s: float = 15) -> None:
    """Wait until daemon `node_id` holds the lease of `wid`."""
    sql = (
        "SELECT split_part(owner, ' ', 2) FROM workflows WHERE id = $1"
        " AND lease_until > extract(epoch FROM clock_timestamp())"
    )
    await until_value(dsn, sql, node_id, wid, limit_s=limit_s)


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


class TestShared:
    async def test_ping_lists_the_nodes_and_show_names_the_owner(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """Every daemon serves everything: ping lists the live nodes, show names the owner, and a
        clean stop hands its workflows to the others at once (not after its leases ran out)."""
        steplog = short_tmp / "steps.log"
        # A lease far longer than the waits below: only the handover can explain a takeover.
        a, b = (node(short_tmp, n, pg_dsn, steplog, lease_s=60) for n in ("a", "b"))
        try:
            await a.start()
            async with a.client() as c:
                await c.call("start", workflow="Snooze", workflow_id="w",
                             input={"id": "w", "delay_s": 3600})  # fmt: skip
                await held_by(pg_dsn, "w", "a")
            await b.start()
            for d in (a, b):
                async with d.client() as c:
                    pinged = await c.call("ping")
                    assert [(n["node_id"], n["role"]) for n in pinged["nodes"]] == [
                        ("a", "leader"), ("b", "member"),
                    ]  # fmt: skip
                    assert pinged["role"] == ("leader" if d is a else "member")
                    shown = await c.call("show", workflow_id="w")
                    assert shown["owner"] == "a" and shown["data"]["id"] == "w"
                    assert [r["workflow_id"] for r in await c.call("list")] == ["w"]
            argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(b.socket), "ping"]
            done = await anyio.run_process(argv, check=False, cwd=REPO)
            assert done.returncode == 0, done.stderr
            assert done.stdout.decode().endswith("; nodes: a (leader), b (member)\n")
            assert await a.stop() == 0
            await held_by(pg_dsn, "w", "b", limit_s=10)  # released at the stop: no lease to wait
            async with b.client() as c:
                await eventually(
                    lambda: _role(c, "leader"), 30
                )  # the leader row went with a's stop
                pinged = await c.call("ping")
                assert [(n["node_id"], n["role"]) for n in pinged["nodes"]] == [("b", "leader")]
                await c.call("cancel", workflow_id="w")
                shown = await wait_status(c, "w", "Cancelled")
                assert shown["owner"] is None  # it ended
        finally:
            await stop_all(a, b)

    @pytest.mark.parametrize("n", [2, 3])
    async def test_thousand_workflows_through_one_finish_once_on_every_daemon(
        self, short_tmp: Path, pg_dsn: str, n: int
    ) -> None:
        """1,000 workflows started through one of two or three daemons all finish, each step
        once, and every daemon ran a share of them."""
        steplog = short_tmp / "steps.log"
        # Leases long enough that a daemon starved of CPU (a loaded box) keeps its work: a
        # takeover would re-run the steps in flight, which this test is not about.
        group = [node(short_tmp, name, pg_dsn, steplog, lease_s=15) for name in "abc"[:n]]
        try:
            for d in group:
                await d.start()
            async with group[0].client() as c:
                for i in range(1000):
                    await c.call("start", workflow="Steps", workflow_id=f"w{i}",
                                 input={"id": f"w{i}", "n": 2, "delay_s": 0})  # fmt: skip
                await until_finished(pg_dsn, 1000)
            for d in group:
                async with d.client() as c:
                    await settled(c)
            runs = step_runs(steplog)
            assert len(runs) == 2000 and set(runs.values()) == {1}
            shares = await owners(pg_dsn)
            assert set(shares) == set("abc"[:n]), shares
            assert sum(shares.values()) == 1000
        finally:
            await stop_all(*group)

    async def test_send_and_cancel_through_a_daemon_that_does_not_own_it(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """A send through a daemon that does not run the workflow reaches its owner at once and
        brings the handler's answer back; `wait=False` is queued; a cancel goes through too."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        try:
            await a.start()
            async with a.client() as c:
                for wid in ("g", "h"):
                    await c.call("start", workflow="Turnstile", workflow_id=wid,
                                 input={"id": wid, "need": 3})  # fmt: skip
                    await wait_status(c, wid, "Waiting")
                    await held_by(pg_dsn, wid, "a")
            await b.start()
            async with b.client() as c:
                assert (await c.call("show", workflow_id="g"))["owner"] == "a"
                assert await c.call("send", workflow_id="g", event="add", input=1) == 1
                queued = await c.call("send", workflow_id="g", event="add", input=2, wait=False)
                assert queued == {"queued": True}
                refused = await c.request("send", workflow_id="g", event="nope", input=1)
                assert refused["ok"] is False and refused["error"]["code"] == "not_found"
                assert await c.call("send", workflow_id="g", event="add", input=3) == 3
                shown = await wait_status(c, "g", "Finished")
                assert shown["data"]["got"] == [1, 2, 3]
                cancelled = await c.call("cancel", workflow_id="h")
                assert cancelled["status"] == "Cancelled"
                assert (await c.call("show", workflow_id="h"))["status"] == "Cancelled"
                ended = await c.call("wait", workflow_ids=["g", "h"], timeout_s=10)
                assert not ended["timed_out"]
            assert await owners(pg_dsn) == {"a": 2}  # b applied nothing itself
            assert step_runs(steplog)["g count3"] == 1
        finally:
            await stop_all(a, b)

    async def test_the_server_dropping_every_connection_is_survived(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """The server ending all connections of two daemons mid-run (a restart, a failover of the
        server): writes are retried, leases renewed, wake-ups heard again, everything finishes."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        try:
            await a.start()
            await b.start()
            async with a.client() as c:
                for i in range(20):
                    await c.call("start", workflow="Steps", workflow_id=f"w{i}",
                                 input={"id": f"w{i}", "n": 20, "delay_s": 0.01})  # fmt: skip
                await logged(a, "step_done", count=5)
                # Durable before the drop (read just before it: a lower bound), so never re-run.
                durable = {
                    r[0]: json.loads(r[1])["i"]
                    for r in await query(
                        pg_dsn, "SELECT id, data FROM workflows WHERE name = 'Steps'"
                    )
                }
                await terminate_connections(pg_dsn)
                await until_finished(pg_dsn, 20, limit_s=60)
                assert (await c.call("ping"))["workflows"] == {"Finished": 20}
                # New work still reaches a daemon at once: the LISTEN connection came back.
                await c.call("start", workflow="Steps", workflow_id="late",
                             input={"id": "late", "n": 1, "delay_s": 0})  # fmt: skip
                await wait_status(c, "late", "Finished", limit_s=LEASE_S + 10)
            for d in (a, b):
                assert d.proc is not None and d.proc.poll() is None
                assert not [r for r in d.records() if r.get("event") == "lease_lost"]
            runs = step_runs(steplog)
            # A failed write makes its workflow go back to its durable state: the steps after
            # it may run again (pipelined checkpoints: README), none before it.
            for wid, i in durable.items():
                assert all(runs[f"{wid} s{k}"] == 1 for k in range(i)), (wid, i, runs)
        finally:
            await stop_all(a, b)


async def _role(c: Any, role: str) -> bool:
    return bool((await c.call("ping"))["role"] == role)


class TestTakeover:
    async def test_sigkill_hands_its_workflows_to_the_others(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """SIGKILL one of two daemons mid-run: the other claims its workflows within lease_s +
        5 s and finishes them, keeps every acknowledged send, re-runs no checkpointed step."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        steps = [f"s{i}" for i in range(20)]
        gates = [f"t{i}" for i in range(10)]
        try:
            await a.start()
            await b.start()
            async with a.client() as c:
                for wid in steps:
                    await c.call("start", workflow="Steps", workflow_id=wid,
                                 input={"id": wid, "n": 10, "delay_s": 0.05})  # fmt: skip
                for wid in gates:
                    await c.call("start", workflow="Turnstile", workflow_id=wid,
                                 input={"id": wid, "need": 3})  # fmt: skip
                for wid in gates:
                    await wait_status(c, wid, "Waiting")
                    await c.call("send", workflow_id=wid, event="add", input=1)
                    await c.call("send", workflow_id=wid, event="add", input=2, wait=False)
            shares = await owners(pg_dsn)
            assert shares["a"] > 0 and shares["b"] > 0, shares
            await a.kill()
            killed = time.monotonic()
            # What a had made durable: its steps before `i` must never run again. The steps
            # after it may (pipelined checkpoints: README, "a crash re-runs at most ...").
            durable = {
                r[0]: json.loads(r[1])["i"]
                for r in await query(pg_dsn, "SELECT id, data FROM workflows WHERE name = 'Steps'")
            }
            orphans = [
                r[0]
                for r in await query(
                    pg_dsn,
                    "SELECT id FROM workflows WHERE owner LIKE 'workflowd a %'"
                    " AND name = 'Steps' AND status <> 'Finished'",
                )
            ]
            sql = (
                "SELECT COUNT(*) FROM workflows WHERE owner LIKE 'workflowd a %'"
                " AND status NOT IN ('Finished', 'Failed', 'Cancelled')"
            )
            await until_value(pg_dsn, sql, 0, limit_s=LEASE_S + 5)
            # The dead one's running workflows finish on the other within lease_s + 5 s.
            await until_value(
                pg_dsn,
                "SELECT COUNT(*) FROM workflows WHERE id = ANY($1::text[]) AND status <> 'Finished'",
                0,
                orphans,
                limit_s=max(killed + LEASE_S + 5 - time.monotonic(), 0.1),
            )
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
            # A step whose checkpoint was durable at the kill ran once; a later one at most
            # twice (it may have run on a before the kill, then again on b).
            for wid in steps:
                assert all(runs[f"{wid} s{i}"] == 1 for i in range(durable[wid])), (wid, runs)
                assert all(runs[f"{wid} s{i}"] in (1, 2) for i in range(10)), (wid, runs)
        finally:
            await stop_all(a, b)


class TestPartition:
    async def test_stopped_daemon_writes_nothing_for_the_workflows_it_lost(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """SIGSTOP a daemon past its lease: the other claims its workflow and finishes it; on
        SIGCONT the stopped one, whose timer is overdue, writes nothing for it (its generation
        moved on), logs `lease_lost` and drops it, and lives on."""
        steplog = short_tmp / "steps.log"
        a, b = node(short_tmp, "a", pg_dsn, steplog), node(short_tmp, "b", pg_dsn, steplog)
        try:
            await a.start()
            async with a.client() as c:
                await c.call("start", workflow="Snooze", workflow_id="w",
                             input={"id": "w", "delay_s": LEASE_S + 1})  # fmt: skip
                await wait_status(c, "w", "Waiting")
                await held_by(pg_dsn, "w", "a")
            (generation,) = (await query(pg_dsn, "SELECT generation FROM workflows"))[0]
            await b.start()
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            try:
                await held_by(pg_dsn, "w", "b", limit_s=LEASE_S + 15)
                async with b.client() as c:
                    shown = await wait_status(c, "w", "Finished")
                    assert shown["data"]["runs"] == 1
                    # Logged after its last save (the end is saved twice): b is done writing.
                    await logged(b, "workflow_finished", workflow_id="w")
                    await settled(c)
                before = await snapshot(pg_dsn)
                after_claim = (await query(pg_dsn, "SELECT generation FROM workflows"))[0][0]
                assert after_claim == generation + 1
            finally:
                a.proc.send_signal(signal.SIGCONT)
            # Its timer was due while it was stopped: it fires now, and its checkpoint is fenced.
            await logged(a, "lease_lost", workflow_id="w")
            async with a.client() as c:
                assert (await c.call("show", workflow_id="w"))["status"] == "Finished"
                await settled(c)
            assert a.proc.poll() is None, a.output()
            assert await snapshot(pg_dsn) == before
            assert step_runs(steplog)["w work"] >= 1
        finally:
            await stop_all(a, b)


class TestSingletons:
    async def test_a_schedule_on_two_daemons_fires_each_time_once(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """Both daemons run the schedule; each nominal time starts one workflow, recorded once."""
        steplog = short_tmp / "steps.log"
        chime = {"name": "tick", "workflow": "Chime", "every": 1, "overlap": "allow"}
        env = {SCHEDULES_ENV: json.dumps([chime])}
        a, b = (node(short_tmp, n, pg_dsn, steplog, env=env) for n in ("a", "b"))
        try:
            await a.start()
            await b.start()
            await until_value(
                pg_dsn, "SELECT COUNT(*) >= 4 FROM workflows WHERE status = 'Finished'", True,
                limit_s=30,
            )  # fmt: skip
            async with b.client() as c:
                shown = await c.call("schedule_show", name="tick")
            nominals = [f["nominal_at"] for f in shown["fires"] if f["kind"] == "fired"]
            assert nominals and len(nominals) == len(set(nominals)), shown["fires"]
            rows = await query(pg_dsn, "SELECT id FROM workflows WHERE id LIKE 'tick:%'")
            assert len(rows) >= len(nominals) - 1
        finally:
            await stop_all(a, b)


class TestPinning:
    async def test_a_file_wait_stays_on_its_node_until_that_node_is_gone(
        self, short_tmp: Path, pg_dsn: str
    ) -> None:
        """A workflow waiting on a FileWatch is claimed only by its node (a restart takes it
        back even though another daemon is free); once that node is gone for pin_timeout_s,
        the other daemon claims it, logs `wait_moved` and sets the watch up again there."""
        steplog = short_tmp / "steps.log"
        drop = short_tmp / "drop"
        drop.mkdir()
        pin: dict[str, Any] = {"pin_timeout_s": 6.0}
        a = node(short_tmp, "a", pg_dsn, steplog, **pin)
        b = node(short_tmp, "b", pg_dsn, steplog, **pin)
        try:
            await a.start()
            async with a.client() as c:
                await c.call("start", workflow="Parcel", workflow_id="p",
                             input={"id": "p", "path": str(drop / "x")})  # fmt: skip
                await wait_status(c, "p", "Waiting")
            await until_value(pg_dsn, "SELECT pin_node FROM workflows", "a")
            await b.start()
            await a.kill()
            again = node(short_tmp, "a", pg_dsn, steplog, **pin)
            await again.start()  # the same node, a new process: the pin is its own
            await held_by(pg_dsn, "p", "a", limit_s=LEASE_S + 10)
            assert not [r for r in b.records() if r.get("event") == "wait_moved"]
            (generation,) = (await query(pg_dsn, "SELECT generation FROM workflows"))[0]
            assert generation == 2  # a, then a again: b never held it
            await again.kill()
            killed = time.monotonic()
            (moved,) = await logged(b, "wait_moved", limit_s=6.0 + LEASE_S + 10)
            assert moved["workflow_id"] == "p"
            assert time.monotonic() - killed >= 6.0 - 1.0  # not before its node was gone
            await held_by(pg_dsn, "p", "b")
            async with b.client() as c:
                await until_value(pg_dsn, "SELECT pin_node FROM workflows", "b")
                (drop / "x").write_text("here")
                shown = await wait_status(c, "p", "Finished", limit_s=15)
                assert shown["data"]["runs"] == 1
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
