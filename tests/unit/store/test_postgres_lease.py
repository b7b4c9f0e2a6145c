"""Tests for daemon.store.postgres_lease and the per-workflow leases of daemon.store.postgres."""

from __future__ import annotations

from typing import Any

import anyio
import asyncpg
import pytest

from daemon.store.base import FireRecord, WorkflowLost, WorkflowRow
from daemon.store.postgres import PostgresStore
from daemon.store.postgres_lease import holder_name


def row(wid: str) -> WorkflowRow:
    """Build a fresh workflow row."""
    return WorkflowRow(id=wid, name="Demo", status="Resuming", data='{"i":0}', state="{}")


async def expire(dsn: str) -> None:
    """Let every lease run out now (as if its daemon had stopped renewing long ago)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE workflows SET lease_until = 0")
    finally:
        await conn.close()


def test_holder_names_are_unique_and_fit_application_name() -> None:
    """Two processes of one node get different names, at most 63 bytes long."""
    a, b = holder_name("n" * 100), holder_name("n" * 100)
    assert a != b and len(a.encode()) <= 63


async def test_claims_split_work_and_fence_the_loser(pg_dsn: str) -> None:
    """Two daemons claim disjoint workflows; once one's lease ran out and the other claimed
    it, the first one's checkpoint writes nothing and raises WorkflowLost."""
    async with (
        PostgresStore.open(pg_dsn, node_id="a", lease_s=30) as a,
        PostgresStore.open(pg_dsn, node_id="b", lease_s=30) as b,
    ):
        for i in range(6):
            await a.create(row(f"w{i}"))
        first = await a.claim(4)
        second = await b.claim(4)
        mine = {r.id for r in first.rows}
        theirs = {r.id for r in second.rows}
        assert len(mine) == 4 and len(theirs) == 2 and not mine & theirs
        assert all(a.owns(w) for w in mine) and not any(a.owns(w) for w in theirs)
        assert (await a.claim(4)).rows == []  # nothing left nobody holds
        assert await a.owner_of("w0") in ("a", "b")
        victim = min(mine)
        await a.checkpoint(victim, status="Waiting", data='{"i":1}', state="{}")
        await expire(pg_dsn)
        taken = await b.claim(10)
        assert victim in {r.id for r in taken.rows}
        with pytest.raises(WorkflowLost):
            await a.checkpoint(victim, status="Waiting", data='{"i":2}', state="{}")
        got = await a.get(victim)
        assert got is not None and got.data == '{"i":1}'
        assert not a.owns(victim)
        with pytest.raises(WorkflowLost):  # nor does its stale copy take it back
            await a.checkpoint(victim, status="Finished", data='{"i":3}', state="{}")
        await b.checkpoint(victim, status="Waiting", data='{"i":4}', state="{}")
        assert sorted(await a.renew()) == sorted(mine - {victim})  # b took all at expiry
        assert await a.owner_of(victim) == "b"


async def test_renew_reports_what_was_lost(pg_dsn: str) -> None:
    """A renewal keeps the leases still held and names the ones another daemon took."""
    async with (
        PostgresStore.open(pg_dsn, node_id="a", lease_s=30) as a,
        PostgresStore.open(pg_dsn, node_id="b", lease_s=30) as b,
    ):
        await a.create(row("x"))
        await a.create(row("y"))
        assert {r.id for r in (await a.claim(10)).rows} == {"x", "y"}
        assert await a.renew() == []
        await expire(pg_dsn)
        await b.claim(10)
        assert sorted(await a.renew()) == ["x", "y"]
        assert a.leads() and not b.leads()  # a beat first: the leader row is a's


async def test_inbox_goes_to_the_owner_and_answers_come_back(pg_dsn: str) -> None:
    """A request through a non-owner is taken by the owner only; its answer reaches the sender."""
    async with (
        PostgresStore.open(pg_dsn, node_id="a", lease_s=30) as a,
        PostgresStore.open(pg_dsn, node_id="b", lease_s=30) as b,
    ):
        await a.create(row("w"))
        await a.claim(10)
        inbox_id = await b.request("w", "callback", "go", {"n": 1}, reply=True)
        assert await b.take_inbox() == []
        (taken,) = await a.take_inbox()
        assert (taken.row.id, taken.row.event, taken.kind) == (inbox_id, "go", "callback")
        assert taken.reply_to == b.holder and await a.take_inbox() == []  # taken once
        await a.answer(inbox_id, b.holder, True, 7, done=False)
        assert await b.answers() == [(inbox_id, True, 7)]
        assert await b.answers() == []


async def test_a_clean_stop_releases_every_lease(pg_dsn: str) -> None:
    """Leaving hands the workflows (and the leader row) over at once."""
    async with PostgresStore.open(pg_dsn, node_id="a", lease_s=300) as a:
        await a.create(row("w"))
        await a.claim(10)
    async with PostgresStore.open(pg_dsn, node_id="b", lease_s=300) as b:
        assert [r.id for r in (await b.claim(10)).rows] == ["w"]
        assert b.leads()


async def test_a_fire_two_daemons_make_starts_one_workflow_recorded_once(pg_dsn: str) -> None:
    """The fire's workflow id is its key: the second daemon firing it creates and records
    nothing."""
    async with (
        PostgresStore.open(pg_dsn, node_id="a", lease_s=30) as a,
        PostgresStore.open(pg_dsn, node_id="b", lease_s=30) as b,
    ):
        await a.schedules_load(["tick"], 100.0)
        fire = FireRecord(101.0, "fired", nominal=101.0, workflow_id="tick:101")
        assert await a.schedule_fire("tick", row("tick:101"), last_nominal=101.0, records=[fire])
        assert not await b.schedule_fire("tick", row("tick:101"), last_nominal=101.0,
                                          records=[fire])  # fmt: skip
        assert [f.workflow_id for f in await b.schedule_fires("tick")] == ["tick:101"]


async def test_a_write_issued_under_a_lost_lease_never_takes_the_workflow_back(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two checkpoints of a stale copy in flight at once (pipelined), after another daemon took
    the workflow and finished it: the first one's failure must not let the second one claim the
    ended workflow (nobody holds an ended one) and write the stale state over its end."""
    async with (
        PostgresStore.open(pg_dsn, node_id="a", lease_s=30) as a,
        PostgresStore.open(pg_dsn, node_id="b", lease_s=30) as b,
    ):
        await a.create(row("w"))
        await a.claim(1)
        await expire(pg_dsn)
        await b.claim(1)
        await b.checkpoint("w", status="Finished", data='{"i":9}', state="{}")
        real = a._writes.submit
        first_failed = anyio.Event()
        submitted: list[object] = []

        async def in_order(apply: Any) -> Any:
            # The second write was issued beside the first; it reaches the writer after the
            # first one's failure was seen (as a later batch does).
            submitted.append(apply)
            if len(submitted) > 1:
                await first_failed.wait()
            return await real(apply)

        monkeypatch.setattr(a._writes, "submit", in_order)
        outcomes: list[BaseException | None] = []

        async def stale(i: int) -> None:
            try:
                await a.checkpoint("w", status="Resuming", data=f'{{"i":{i}}}', state="{}")
                outcomes.append(None)
            except WorkflowLost as e:
                outcomes.append(e)
            if i == 1:
                first_failed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stale, 1)
            tg.start_soon(stale, 2)
        got = await a.get("w")
        assert got is not None and (got.status, got.data) == ("Finished", '{"i":9}')
        assert all(isinstance(o, WorkflowLost) for o in outcomes), outcomes
