"""Many schedules due at once in a real `workflowd`: one write for their fires, and across a
SIGKILL still exactly one workflow per schedule and nominal time.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import anyio

from tests.helpers.harness import Daemon, running_daemon
from tests.helpers.wait import eventually, wait_status
from tests.workflows.schedules import SCHEDULES_ENV

MODULES = ["tests.workflows.schedules"]
#: Schedules every second, all due at the same instants.
MANY = 300


def env_of(*schedules: dict[str, Any]) -> dict[str, str]:
    """Return the daemon environment that gives it these schedules (Schedule keyword args)."""
    return {SCHEDULES_ENV: json.dumps(list(schedules))}


def every_second(name: str, **more: Any) -> dict[str, Any]:
    """A Chime every second; overlap allowed, so each second starts one whatever ran before."""
    return {"name": name, "workflow": "Chime", "every": 1, "overlap": "allow", **more}


def query(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """Read the daemon's database on a connection of this test's own (WAL: no lock taken)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def fired(db: Path) -> list[tuple[str, float, float, str]]:
    """Return every start record: schedule, nominal time, when it was committed, workflow id."""
    return query(
        db,
        "SELECT schedule, nominal, at, workflow_id FROM schedule_fires"
        " WHERE kind IN ('fired', 'caught_up')",
    )


async def wait_all_fired(db: Path, after: float, n: int) -> float:
    """Wait until every schedule fired `n` nominal times after `after`; return the first one."""

    async def done() -> bool:
        per = Counter(nominal for _, nominal, _, _ in fired(db) if nominal > after)
        return len(per) >= n and all(per[t] == MANY for t in sorted(per)[:n])

    await eventually(done, limit_s=60)
    return min(nominal for _, nominal, _, _ in fired(db) if nominal > after)


class TestManyAtOnce:
    async def test_fires_due_together_commit_together(self, tmp_path: Path) -> None:
        """The fires of one nominal time commit in one transaction (one stamp), not one each."""
        env = env_of(*(every_second(f"m{i:03d}") for i in range(MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            # The first fires after start may have met the load; a later second is steady.
            first = await wait_all_fired(db, time.time() + 1, 1)
            rows = [r for r in fired(db) if r[1] == first]
            assert len(rows) == MANY and len({r[0] for r in rows}) == MANY
            stamps = {at for _, _, at, _ in rows}
            assert len(stamps) == 1, f"{len(stamps)} commit stamps for {MANY} fires due at once"
            (stamp,) = stamps
            assert stamp >= first  # committed at or after its nominal time, never before

    async def test_kill_during_a_batch(self, tmp_path: Path) -> None:
        """Killed while many fires are written, each schedule still starts each nominal time
        exactly once, with no gap, and every record names a workflow that exists."""
        env = env_of(*(every_second(f"m{i:03d}", catchup="all") for i in range(MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            for offset in (0.0, 0.005, 0.02):
                await wait_all_fired(db, time.time(), 1)
                due = int(time.time()) + 1 + offset
                await anyio.sleep(due - time.time())
                await d.kill()
                await d.start()
            await wait_all_fired(db, time.time() + 1, 2)
            await d.stop()
        assert_each_once(db)

    async def test_kill_while_fires_are_built_ahead(self, tmp_path: Path) -> None:
        """Killed in the second before a nominal time, while its fires are built but not
        written, each schedule still starts each nominal time exactly once, with no gap."""
        env = env_of(*(every_second(f"m{i:03d}", catchup="all") for i in range(MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            for offset in (0.6, 0.3, 0.05):
                await wait_all_fired(db, time.time(), 1)
                due = int(time.time()) + 1
                due += 1 if due - offset < time.time() + 0.05 else 0  # that window has begun
                await anyio.sleep(due - offset - time.time())
                await d.kill()
                early = [r for r in fired(db) if r[2] < r[1]]
                assert early == [], f"fires written before their time: {early[:3]}"
                await d.start()
            await wait_all_fired(db, time.time() + 1, 2)
            await d.stop()
        assert_each_once(db)

    async def test_one_log_line_per_fire(self, tmp_path: Path) -> None:
        """A batch-fired workflow's start is logged once, as `schedule_fired` naming it."""
        env = env_of(*(every_second(f"m{i:03d}") for i in range(MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            first = await wait_all_fired(db, time.time() + 1, 1)

            async def logged_all() -> bool:
                return len(of_fire(d.records(), first)) >= MANY

            await eventually(logged_all)
            lines = of_fire(d.records(), first)
            assert Counter(r["event"] for r in lines) == {"schedule_fired": MANY}
            assert {r["workflow"] for r in lines} == {"Chime"}


def of_fire(records: list[dict[str, Any]], nominal: float) -> list[dict[str, Any]]:
    """Return the records about starting the workflows of one nominal time."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(nominal))
    return [
        r
        for r in records
        if str(r.get("workflow_id", "")).endswith(f":{at}")
        and r.get("event") in ("schedule_fired", "workflow_started")
    ]


def assert_each_once(db: Path, count: int = MANY) -> None:
    """Check that each schedule started each nominal time once, with no gap between its
    first and last, and that every record names a workflow that exists, started once."""
    rows = fired(db)
    per: dict[str, list[float]] = defaultdict(list)
    for name, nominal, _, _ in rows:
        per[name].append(nominal)
    assert len(per) == count
    for name, nominals in per.items():
        ordered = sorted(nominals)
        assert len(set(ordered)) == len(ordered), f"{name} fired a nominal time twice"
        assert ordered == [float(t) for t in range(int(ordered[0]), int(ordered[-1]) + 1)], (
            f"{name} lost a fire"
        )
    ids = {r[0] for r in query(db, "SELECT id FROM workflows")}
    assert {wid for *_, wid in rows} <= ids
    started = query(
        db, "SELECT workflow_id, COUNT(*) FROM history WHERE kind = 'started' GROUP BY 1"
    )
    assert {n for _, n in started} == {1}


class TestBatchStartedRuns:
    async def test_cancel_stop_and_restart(self, tmp_path: Path) -> None:
        """The runs a batch of fires starts share one task: each still takes a cancel in its
        step, a stop ends them all cleanly, and after a restart each runs again and finishes."""
        flag = tmp_path / "wake"
        env = env_of(
            *(
                {"name": f"d{i:03d}", "workflow": "Dozes", "every": 1, "input": {"flag": str(flag)}}
                for i in range(MANY)
            )
        )
        async with running_daemon(
            tmp_path, MODULES, env=env, daemon={"shutdown_grace_s": 0.5}
        ) as d:
            db = d.tmp / "wd.db"
            async with d.client() as c:

                async def all_in_their_step() -> bool:
                    return bool((await c.call("ping"))["busy"] >= MANY)

                # overlap="skip": each schedule's first run stays in its step, the rest skip.
                await eventually(all_in_their_step, limit_s=60)
                ((victim,),) = query(db, "SELECT id FROM workflows WHERE id LIKE 'd007:%'")
                await c.call("cancel", workflow_id=victim)
                await wait_status(c, victim, "Cancelled", limit_s=10)
            code = await d.stop()
            assert code == 0, d.output()
            assert "Traceback" not in d.output()
            stopped = dict(query(db, "SELECT id, status FROM workflows"))
            assert len(stopped) == MANY
            assert {s for w, s in stopped.items() if w != victim} == {"Resuming"}
            flag.touch()
            await d.start()

            def first_runs() -> dict[str, tuple[str, Any]]:
                rows = query(db, "SELECT id, status, data FROM workflows")
                return {w: (s, json.loads(data)) for w, s, data in rows if w in stopped}

            async def all_woke() -> bool:
                return all(s != "Resuming" for s, _ in first_runs().values())

            await eventually(all_woke, limit_s=60)
            runs = first_runs()
            await d.stop()
        assert {w: s for w, (s, _) in runs.items()} == {
            w: "Cancelled" if w == victim else "Finished" for w in stopped
        }
        assert all(data["woke"] for w, (_, data) in runs.items() if w != victim)
        started = query(
            db, "SELECT workflow_id, COUNT(*) FROM history WHERE kind = 'started' GROUP BY 1"
        )
        assert {n for _, n in started} == {1}


class TestRunsBehindTheFires:
    async def test_fires_go_on_while_runs_wait_and_a_kill_strands_none(
        self, tmp_path: Path
    ) -> None:
        """Runs that stay in their step (more than may run at once) hold no fire back: each
        schedule fires each second meanwhile, every run fired counts as work in progress (in
        its step or waiting its turn), and after a SIGKILL the restart runs each to its end."""
        flag = tmp_path / "wake"
        env = env_of(
            *(
                every_second(f"z{i:03d}", workflow="Dozes", input={"flag": str(flag)})
                for i in range(MANY)
            )
        )
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            await wait_all_fired(db, time.time(), 3)
            async with d.client() as c:
                busy = (await c.call("ping"))["busy"]
            assert busy >= 3 * MANY, f"{busy} runs in progress after {3 * MANY} fires"
            await d.kill()
            before = dict(query(db, "SELECT id, status FROM workflows"))
            assert len(before) >= 3 * MANY and set(before.values()) == {"Resuming"}
            flag.touch()
            await d.start()

            async def all_finished() -> bool:
                now = dict(query(db, "SELECT id, status FROM workflows"))
                return all(now[w] == "Finished" for w in before)

            await eventually(all_finished, limit_s=60)
            await d.stop()
        started = query(
            db, "SELECT workflow_id, COUNT(*) FROM history WHERE kind = 'started' GROUP BY 1"
        )
        assert {n for _, n in started} == {1}
        assert_each_once(db)


# -- a large instant's fires committed ahead of it ---------------------------------------
# Each fires once, its workflow runs at its instant and not before, a SIGKILL in between
# loses and doubles nothing, a pause in between takes the fire back, and a lone schedule
# keeps the path at its instant.

#: Schedules every second, all due at the same instants: enough for their commit to go
#: ahead of the instant (over EARLY_OVER_S at the default commit cost per fire).
EARLY_MANY = 600
#: How long a test looks for the moment between an early commit and its instant.
LOOK_S = 20.0


async def wait_fired(db: Path, after: float, n: int, count: int = EARLY_MANY) -> None:
    """Wait until `count` schedules fired each of `n` nominal times after `after`."""

    async def done() -> bool:
        per: dict[float, int] = defaultdict(int)
        for _, nominal, _, _ in fired(db):
            if nominal > after:
                per[nominal] += 1
        return len(per) >= n and all(per[t] == count for t in sorted(per)[:n])

    await eventually(done, limit_s=60)


def ran_before_their_time(db: Path) -> list[tuple[str, float, float]]:
    """Return the workflows committed early with a step or end recorded before their time."""
    return query(
        db,
        "SELECT w.id, w.not_before, MIN(h.at) FROM workflows w JOIN history h"
        " ON h.workflow_id = w.id AND h.kind != 'started'"
        " WHERE w.not_before IS NOT NULL GROUP BY w.id HAVING MIN(h.at) < w.not_before",
    )


async def between(d: Daemon, like: str = "%") -> tuple[str, float]:
    """Return a workflow (id, not_before) committed ahead of an instant still to come."""
    db = d.tmp / "wd.db"
    deadline = time.monotonic() + LOOK_S
    while time.monotonic() < deadline:
        rows = query(
            db,
            "SELECT id, not_before FROM workflows WHERE not_before > ? AND id LIKE ? LIMIT 1",
            (time.time(), like),
        )
        if rows:
            wid, at = rows[0]
            return str(wid), float(at)
        await anyio.sleep(0.002)
    raise AssertionError(f"no early commit seen in {LOOK_S} s")


class TestEarlyCommit:
    async def test_many_go_early_each_fires_once_and_runs_at_its_instant(
        self, tmp_path: Path
    ) -> None:
        """Many schedules due at once take the early path; each fires once per nominal time,
        and no workflow committed early runs before its instant."""
        env = env_of(*(every_second(f"e{i:03d}") for i in range(EARLY_MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            await wait_fired(db, time.time() + 1, 3)
            early = [r for r in d.records() if r.get("event") == "schedules_committed_early"]
            await d.stop()
        assert early, "no instant was committed ahead of its time"
        ((n,),) = query(db, "SELECT COUNT(*) FROM workflows WHERE not_before IS NOT NULL")
        assert n >= EARLY_MANY
        # Its record says when the fire took effect: at its instant, not at the commit.
        assert query(
            db,
            "SELECT COUNT(*) FROM schedule_fires f JOIN workflows w ON w.id = f.workflow_id"
            " WHERE w.not_before IS NOT NULL AND f.at < w.not_before",
        ) == [(0,)]
        assert ran_before_their_time(db) == []
        assert_each_once(db, EARLY_MANY)

    async def test_a_kill_between_commit_and_instant(self, tmp_path: Path) -> None:
        """SIGKILLed after an instant's fires were committed early and before the instant:
        they stay durable, and after the restart each of their workflows runs once, not
        before its instant; no schedule loses or doubles a fire."""
        env = env_of(*(every_second(f"e{i:03d}", catchup="all") for i in range(EARLY_MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            await wait_fired(db, time.time(), 1)
            _, at = await between(d)
            await d.kill()
            killed = time.time()
            pending = dict(
                query(db, "SELECT id, status FROM workflows WHERE not_before = ?", (at,))
            )
            assert len(pending) == EARLY_MANY  # all of that instant's fires were durable
            if killed < at:  # (almost always: the kill is ~ms after the look)
                assert set(pending.values()) == {"Resuming"}, "ran before its instant"
            await d.start()

            async def all_finished() -> bool:
                rows = dict(
                    query(db, "SELECT id, status FROM workflows WHERE not_before = ?", (at,))
                )
                return set(rows.values()) == {"Finished"}

            await eventually(all_finished, limit_s=60)
            await wait_fired(db, time.time() + 1, 1)
            await d.stop()
        assert ran_before_their_time(db) == []
        assert_each_once(db, EARLY_MANY)

    async def test_a_pause_between_takes_the_fire_back(self, tmp_path: Path) -> None:
        """Paused after its fire was committed early and before the instant: that fire is
        taken back (no workflow, no record, the schedule's progress back), and it stays so."""
        env = env_of(
            *(every_second(f"e{i:03d}") for i in range(EARLY_MANY - 1)),
            every_second("victim", catchup="skip"),
        )
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            await wait_fired(db, time.time(), 1)
            async with d.client() as c:
                for _ in range(20):
                    wid, at = await between(d, "victim:%")
                    await c.call("schedule_pause", name="victim")
                    if query(db, "SELECT id FROM workflows WHERE id = ?", (wid,)):
                        # The pause came after the instant: the fire stood. Try again.
                        await c.call("schedule_resume", name="victim")
                        continue
                    break
                else:
                    raise AssertionError("no pause landed between an early commit and its instant")
                assert query(
                    db, "SELECT COUNT(*) FROM schedule_fires WHERE workflow_id = ?", (wid,)
                ) == [(0,)]
                assert query(db, "SELECT COUNT(*) FROM history WHERE workflow_id = ?", (wid,)) == [
                    (0,)
                ]
                ((last, paused),) = query(
                    db, "SELECT last_nominal, paused FROM schedules WHERE name = 'victim'"
                )
                assert last < at and paused == 1
                shown = await c.call("schedule_show", name="victim")
                assert shown["paused"] and shown["last_nominal_at"] < at
                await wait_fired(db, at + 1, 1, count=EARLY_MANY - 1)  # the others went on
                assert query(db, "SELECT id FROM workflows WHERE id = ?", (wid,)) == []
                assert (await c.call("schedule_show", name="victim"))["last_nominal_at"] < at
            await d.stop()

    async def test_a_lone_schedule_keeps_the_path_at_its_instant(self, tmp_path: Path) -> None:
        """One schedule due at an instant is committed at it, as before: nothing early."""
        env = env_of(every_second("lone"))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            await wait_fired(db, time.time(), 3, count=1)
            records = d.records()
            await d.stop()
        assert not [r for r in records if r.get("event") == "schedules_committed_early"]
        assert query(db, "SELECT COUNT(*) FROM workflows WHERE not_before IS NOT NULL") == [(0,)]
        committed = query(db, "SELECT nominal, at FROM schedule_fires WHERE kind = 'fired'")
        assert len(committed) >= 3 and all(at >= nominal for nominal, at in committed)
