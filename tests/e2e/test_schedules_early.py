"""A large instant's fires committed ahead of it, in a real `workflowd`: each fires once, its
workflow runs at its instant and not before, a SIGKILL in between loses and doubles nothing,
a pause in between takes the fire back, and a lone schedule keeps the path at its instant.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import anyio

from tests.e2e.test_schedules_batch import MODULES, env_of, every_second, query
from tests.helpers.harness import Daemon, running_daemon
from tests.helpers.wait import eventually

#: Schedules every second, all due at the same instants: enough for their commit to go
#: ahead of the instant (over EARLY_OVER_S at the default commit cost per fire).
MANY = 600
#: How long a test looks for the moment between an early commit and its instant.
LOOK_S = 20.0


def starts(db: Path) -> list[tuple[str, float, str]]:
    """Return every start record: schedule, nominal time, workflow id."""
    return query(
        db,
        "SELECT schedule, nominal, workflow_id FROM schedule_fires"
        " WHERE kind IN ('fired', 'caught_up')",
    )


async def wait_fired(db: Path, after: float, n: int, count: int = MANY) -> None:
    """Wait until `count` schedules fired each of `n` nominal times after `after`."""

    async def done() -> bool:
        per: dict[float, int] = defaultdict(int)
        for _, nominal, _ in starts(db):
            if nominal > after:
                per[nominal] += 1
        return len(per) >= n and all(per[t] == count for t in sorted(per)[:n])

    await eventually(done, limit_s=60)


def assert_each_once(db: Path, count: int = MANY) -> None:
    """Each schedule started each nominal time once, with no gap; each record's workflow
    exists and was started once."""
    per: dict[str, list[float]] = defaultdict(list)
    rows = starts(db)
    for name, nominal, _ in rows:
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
        env = env_of(*(every_second(f"e{i:03d}") for i in range(MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            await wait_fired(db, time.time() + 1, 3)
            early = [r for r in d.records() if r.get("event") == "schedules_committed_early"]
            await d.stop()
        assert early, "no instant was committed ahead of its time"
        ((n,),) = query(db, "SELECT COUNT(*) FROM workflows WHERE not_before IS NOT NULL")
        assert n >= MANY
        # Its record says when the fire took effect: at its instant, not at the commit.
        assert query(
            db,
            "SELECT COUNT(*) FROM schedule_fires f JOIN workflows w ON w.id = f.workflow_id"
            " WHERE w.not_before IS NOT NULL AND f.at < w.not_before",
        ) == [(0,)]
        assert ran_before_their_time(db) == []
        assert_each_once(db)

    async def test_a_kill_between_commit_and_instant(self, tmp_path: Path) -> None:
        """SIGKILLed after an instant's fires were committed early and before the instant:
        they stay durable, and after the restart each of their workflows runs once, not
        before its instant; no schedule loses or doubles a fire."""
        env = env_of(*(every_second(f"e{i:03d}", catchup="all") for i in range(MANY)))
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            db = d.tmp / "wd.db"
            await wait_fired(db, time.time(), 1)
            _, at = await between(d)
            await d.kill()
            killed = time.time()
            pending = dict(
                query(db, "SELECT id, status FROM workflows WHERE not_before = ?", (at,))
            )
            assert len(pending) == MANY  # all of that instant's fires were durable
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
        assert_each_once(db)

    async def test_a_pause_between_takes_the_fire_back(self, tmp_path: Path) -> None:
        """Paused after its fire was committed early and before the instant: that fire is
        taken back (no workflow, no record, the schedule's progress back), and it stays so."""
        env = env_of(
            *(every_second(f"e{i:03d}") for i in range(MANY - 1)),
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
                await wait_fired(db, at + 1, 1, count=MANY - 1)  # the others went on
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
