"""The Store contract, run against every backend: SQLite files and PostgreSQL databases."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.clock import FakeClock, use_clock
from daemon.errors import Unavailable, WorkflowNotFound
from daemon.observe.metrics import Metrics
from daemon.store.base import WorkflowRow
from daemon.store.postgres import PostgresStore
from daemon.store.sqlite import SQLiteStore

AnyStore = SQLiteStore | PostgresStore
Opener = Callable[..., AbstractAsyncContextManager[AnyStore]]


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Open (and reopen) one fresh database of the backend under test."""
    if request.param == "sqlite":
        db = tmp_path / "wf.db"
        return lambda **kw: SQLiteStore.open(db, **kw)
    dsn: str = request.getfixturevalue("pg_dsn")
    return lambda **kw: PostgresStore.open(dsn, **kw)


def row(wid: str, status: str = "Resuming", name: str = "Demo") -> WorkflowRow:
    """Build a fresh workflow row."""
    return WorkflowRow(id=wid, name=name, status=status, data='{"i":0}', state='{"threads":[]}')


@contextlib.contextmanager
def fake_clock(start: float = 1000.0) -> Iterator[FakeClock]:
    """Make a FakeClock the current clock for the block."""
    clock = FakeClock(start)
    token = use_clock(clock)
    try:
        yield clock
    finally:
        token.var.reset(token)


class TestOpen:
    async def test_reopen_keeps_data(self, opener: Opener) -> None:
        """Rows written before a close are there after reopening."""
        async with opener() as store:
            await store.create(row("a"), history=[("created", {"by": "test"})])
        async with opener() as store:
            got = await store.get("a")
            assert got is not None and got.name == "Demo" and got.created_at > 0
            assert [h.kind for h in await store.history("a")] == ["created"]

    async def test_closed_store_refuses_writes(self, opener: Opener) -> None:
        """A write or a read after the store closed raises Unavailable."""
        async with opener() as store:
            pass
        with pytest.raises(Unavailable):
            await store.create(row("a"))
        with pytest.raises(Unavailable):
            await store.get("a")

    async def test_body_error_propagates_and_unlocks(self, opener: Opener) -> None:
        """An error inside the block comes out as is, and the database is released."""
        with pytest.raises(KeyError, match="boom"):
            async with opener() as store:
                await store.create(row("a"))
                raise KeyError("boom")
        async with opener() as store:
            assert await store.get("a") is not None

    async def test_cancel_unlocks(self, opener: Opener) -> None:
        """Cancelling the block closes the store and releases the lock."""
        with anyio.move_on_after(0.05):
            async with opener() as store:
                await anyio.sleep_forever()
        async with opener() as store:
            assert await store.counts() == {}

    async def test_queued_writes_are_drained(self, opener: Opener) -> None:
        """Writes queued when the store closes are committed, not dropped."""
        async with anyio.create_task_group() as tg, opener() as store:
            for i in range(50):
                tg.start_soon(store.create, row(f"w{i}"))
            await anyio.lowlevel.checkpoint()
        async with opener() as store:
            assert await store.counts() == {"Resuming": 50}


class TestWrites:
    async def test_create_is_idempotent(self, opener: Opener) -> None:
        """A second create with the same id returns False and changes nothing."""
        async with opener() as store:
            assert await store.create(row("a"), history=[("created", {})])
            other = WorkflowRow(id="a", name="Other", status="Waiting", data="{}", state="{}")
            assert not await store.create(other, history=[("created", {})])
            got = await store.get("a")
            assert got is not None and (got.name, got.status) == ("Demo", "Resuming")
            assert len(await store.history("a")) == 1

    async def test_checkpoint_writes_everything(self, opener: Opener) -> None:
        """A checkpoint updates the row, appends history and drops applied inbox rows."""
        async with opener() as store:
            await store.create(row("a"))
            first = await store.inbox_put("a", "go", {"n": 1}, thread_id="main", pc=3)
            second = await store.inbox_put("a", "go", {"n": 2})
            await store.checkpoint(
                "a", status="Waiting", data='{"i":1}', state="{}", attempt=2, next_run_at=5.0,
                history=[("step", {"name": "s1"}), ("wait", {"name": "w"})], inbox_done=[first],
            )  # fmt: skip
            got = await store.get("a")
            assert got is not None
            assert (got.status, got.data, got.attempt, got.next_run_at) == (
                "Waiting", '{"i":1}', 2, 5.0,
            )  # fmt: skip
            assert [(h.kind, h.detail) for h in await store.history("a")] == [
                ("step", {"name": "s1"}), ("wait", {"name": "w"}),
            ]  # fmt: skip
            assert [i.id for i in await store.inbox_pending("a")] == [second]

    async def test_checkpoint_unknown_id(self, opener: Opener) -> None:
        """A checkpoint of an unknown workflow raises WorkflowNotFound and deletes nothing."""
        async with opener() as store:
            await store.create(row("a"))
            put = await store.inbox_put("a", "go", None)
            with pytest.raises(WorkflowNotFound):
                await store.checkpoint("nope", status="Waiting", data="{}", state="{}",
                                       inbox_done=[put])  # fmt: skip
            assert [i.id for i in await store.inbox_pending()] == [put]

    async def test_set_status_and_add_history(self, opener: Opener) -> None:
        """set_status keeps data, keeps attempt when None, and both append history."""
        async with opener() as store:
            await store.create(WorkflowRow("a", "Demo", "Resuming", '{"x":1}', "{}", attempt=3))
            await store.set_status("a", status="Failed", error="bad", history=[("failed", {})])
            await store.add_history("a", "note", {"k": [1, 2]})
            got = await store.get("a")
            assert got is not None
            assert (got.status, got.error, got.attempt, got.data) == ("Failed", "bad", 3, '{"x":1}')
            assert [h.kind for h in await store.history("a")] == ["failed", "note"]
            with pytest.raises(WorkflowNotFound):
                await store.set_status("nope", status="Failed")
            with pytest.raises(WorkflowNotFound):
                await store.add_history("nope", "note", {})

    async def test_history_retention(self, opener: Opener) -> None:
        """Only the newest history_keep entries per workflow are kept."""
        async with opener(history_keep=5) as store:
            await store.create(row("a"), history=[("created", {})])
            await store.create(row("b"), history=[("created", {})])
            for i in range(12):
                await store.add_history("a", "note", {"i": i})
            await store.checkpoint("a", status="Waiting", data="{}", state="{}",
                                   history=[("step", {"i": 12}), ("step", {"i": 13})])  # fmt: skip
            assert [h.detail["i"] for h in await store.history("a")] == [9, 10, 11, 12, 13]
            assert [h.detail["i"] for h in await store.history("a", limit=2)] == [12, 13]
            assert len(await store.history("b")) == 1


class TestGroupCommit:
    async def test_concurrent_checkpoints_share_commits(self, opener: Opener) -> None:
        """200 concurrent checkpoints commit in fewer transactions than writes."""
        async with opener() as store:
            for i in range(200):
                await store.create(row(f"w{i}"))
            before = (store.stats.commits, store.stats.writes)

            async def save(i: int) -> None:
                await store.checkpoint(f"w{i}", status="Waiting", data=f'{{"i":{i}}}', state="{}",
                                       history=[("step", {"i": i})])  # fmt: skip

            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(save, i)
            commits = store.stats.commits - before[0]
            writes = store.stats.writes - before[1]
            assert writes == 200 and commits < writes
            assert (await store.counts()) == {"Waiting": 200}
            got = await store.get("w150")
            assert got is not None and got.data == '{"i":150}'

    async def test_unknown_id_fails_alone(self, opener: Opener) -> None:
        """One checkpoint for an unknown id fails; the rest of its batch commits."""
        async with opener() as store:
            for i in range(50):
                await store.create(row(f"w{i}"))
            errors: list[BaseException] = []

            async def save(wid: str) -> None:
                try:
                    await store.checkpoint(wid, status="Waiting", data="{}", state="{}")
                except WorkflowNotFound as e:
                    errors.append(e)

            async with anyio.create_task_group() as tg:
                for wid in [
                    *(f"w{i}" for i in range(25)),
                    "ghost",
                    *(f"w{i}" for i in range(25, 50)),
                ]:
                    tg.start_soon(save, wid)
            assert [str(e) for e in errors] == ["no workflow 'ghost'"]
            assert store.stats.splits == 1
            assert (await store.counts()) == {"Waiting": 50}


class TestReads:
    async def test_inbox(self, opener: Opener) -> None:
        """Inbox rows come back oldest first, per workflow or all, until marked done."""
        async with opener() as store:
            a1 = await store.inbox_put("a", "go", {"x": [1]}, thread_id="t", pc=4)
            b1 = await store.inbox_put("b", "stop", "now")
            a2 = await store.inbox_put("a", "go", None)
            pending = await store.inbox_pending()
            assert [(i.id, i.workflow_id, i.input) for i in pending] == [
                (a1, "a", {"x": [1]}), (b1, "b", "now"), (a2, "a", None),
            ]  # fmt: skip
            assert (pending[0].event, pending[0].thread_id, pending[0].pc) == ("go", "t", 4)
            assert [i.id for i in await store.inbox_pending("a")] == [a1, a2]
            await store.inbox_done([a1, b1])
            assert [i.id for i in await store.inbox_pending()] == [a2]

    async def test_list_get_counts(self, opener: Opener) -> None:
        """list filters by status and name, newest update first; counts groups by status."""
        with fake_clock() as clock:
            async with opener() as store:
                for wid, status, name in [("a", "Waiting", "X"), ("b", "Finished", "X"),
                                          ("c", "Waiting", "Y")]:  # fmt: skip
                    clock.advance(1)
                    await store.create(row(wid, status, name))
                assert [r.id for r in await store.list()] == ["c", "b", "a"]
                assert [r.id for r in await store.list(status="Waiting")] == ["c", "a"]
                assert [r.id for r in await store.list(status="Waiting", name="X")] == ["a"]
                assert [r.id for r in await store.list(limit=1)] == ["c"]
                assert await store.counts() == {"Waiting": 2, "Finished": 1}
                assert await store.get("zzz") is None

    async def test_ended_with_teardown_errors(self, opener: Opener) -> None:
        """Only ended workflows whose state still holds a failed teardown come back."""
        broken = '{"threads":[{"waits":[{"status":"TeardownError"}]}]}'
        async with opener() as store:
            for wid, status, state in [("a", "Finished", broken), ("b", "Finished", "{}"),
                                       ("c", "Waiting", broken), ("d", "Cancelled", broken)]:  # fmt: skip
                await store.create(WorkflowRow(id=wid, name="Demo", status=status, data="{}",
                                               state=state))  # fmt: skip
            assert sorted(r.id for r in await store.ended_with_teardown_errors()) == ["a", "d"]

    async def test_unfinished_streams_pages(self, opener: Opener) -> None:
        """unfinished yields every non-final row and reads later pages only when reached."""
        async with opener() as store:
            for i in range(35):
                await store.create(row(f"w{i:02}", "Finished" if i % 5 == 0 else "Waiting"))
            await store.create(row("W-upper"))  # byte order: before every lower-case id
            seen = []
            async for r in store.unfinished(page=10):
                seen.append(r.id)
                if r.id == "w01":
                    await store.set_status("w34", status="Cancelled")
            assert seen == ["W-upper", *(f"w{i:02}" for i in range(34) if i % 5)]

    async def test_delete_finished(self, opener: Opener) -> None:
        """Old workflows in a final status are deleted with their history and inbox."""
        with fake_clock(1000.0) as clock:
            async with opener() as store:
                for wid, status in [("a", "Finished"), ("b", "Failed"), ("c", "Waiting")]:
                    await store.create(row(wid, status), history=[("created", {})])
                    await store.inbox_put(wid, "go", None)
                clock.advance(100)
                await store.create(row("d", "Cancelled"), history=[("created", {})])
                assert await store.delete_finished(older_than=1050.0) == 2
                assert sorted(r.id for r in await store.list()) == ["c", "d"]
                assert await store.history("a") == []
                assert [i.workflow_id for i in await store.inbox_pending()] == ["c"]
                assert [len(await store.history(w)) for w in "cd"] == [1, 1]


class TestParentsAndDeadlines:
    async def test_parent_and_deadline_are_stored_and_listed(self, opener: Opener) -> None:
        """A child's parent and a deadline survive a reopen; list keeps one parent's children."""
        async with opener() as store:
            await store.create(row("p"))
            kid = row("p/kid/1")
            kid.parent, kid.deadline = "p", 1234.5
            await store.create(kid)
        async with opener() as store:
            got = await store.get("p/kid/1")
            assert got is not None and (got.parent, got.deadline) == ("p", 1234.5)
            assert [r.id for r in await store.list(parent="p")] == ["p/kid/1"]
            assert await store.list(parent="p/kid/1") == []


class TestListPages:
    """`list` pages: keyset order, stable while rows change."""

    async def test_pages_cover_every_row_once_even_with_ties(self, opener: Opener) -> None:
        """Pages of 3 over rows sharing updated_at list each row once, newest first."""
        with fake_clock() as clock:
            async with opener() as store:
                for n in range(10):
                    if n % 4 == 0:
                        clock.advance(1)  # the others share their time with a neighbour
                    await store.create(row(f"w{n}", "Waiting" if n % 2 else "Resuming"))
                seen, after, pages = [], None, 0
                while True:
                    rows, after = await store.page(limit=3, after=after)
                    seen += rows
                    pages += 1
                    if after is None:
                        break
                waiting, after = await store.page(status="Waiting", limit=10)
        assert [r.id for r in seen] == [f"w{n}" for n in reversed(range(10))]
        assert pages == 4
        assert [r.updated_at for r in seen] == sorted((r.updated_at for r in seen), reverse=True)
        assert [r.id for r in waiting] == ["w9", "w7", "w5", "w3", "w1"] and after is None

    async def test_a_row_changed_between_pages_is_not_listed_twice(self, opener: Opener) -> None:
        """A row listed on page 1 and changed before page 2 moves ahead; page 2 goes on."""
        with fake_clock() as clock:
            async with opener() as store:
                for n in range(6):
                    clock.advance(1)
                    await store.create(row(f"w{n}", "Waiting"))
                first, after = await store.page(limit=3)
                clock.advance(1)
                await store.set_status("w5", status="Finished")  # listed on page 1, now newest
                rest, end = await store.page(limit=3, after=after)
        assert [r.id for r in first] == ["w5", "w4", "w3"]
        assert [r.id for r in rest] == ["w2", "w1", "w0"] and end is None


class TestHookQueue:
    """The endings queue (`hook_runs`): filled by the commit of a Failed or Finished status."""

    async def test_an_ending_is_queued_in_its_own_commit(self, opener: Opener) -> None:
        """Failed and Finished queue one row each; other statuses, and the same again, none."""
        with fake_clock(1000.0):
            async with opener() as store:
                for wid in ("a", "b", "c"):
                    await store.create(row(wid, "Waiting", name="T"))
                await store.checkpoint("a", status="Finished", data="{}", state="{}")
                await store.set_status("b", status="Failed", error="boom")
                await store.set_status("b", status="Failed", error="again")  # no new ending
                await store.set_status("c", status="Cancelled")
                await store.set_status("c", status="Waiting")
                await store.create(row("d", "Finished"))  # an insert is no ending: as SQLite
                pending = await store.hooks_pending()
        assert [(h.workflow_id, h.workflow, h.status, h.error) for h in pending] == [
            ("a", "T", "Finished", None),
            ("b", "T", "Failed", "boom"),
        ]
        assert all(h.at == 1000.0 and h.started_at is None for h in pending)
        assert pending[0].id < pending[1].id

    async def test_claim_done_and_paging(self, opener: Opener) -> None:
        """A claim is durable across a reopen; done rows are gone; `after` pages by id."""
        with fake_clock(1000.0) as clock:
            async with opener() as store:
                for wid in ("a", "b", "c"):
                    await store.create(row(wid, "Waiting"))
                    await store.set_status(wid, status="Failed", error="x")
                first = await store.hooks_pending()
                clock.advance(5)
                await store.hook_claim(first[0].id)
            async with opener() as store:
                again = await store.hooks_pending()
                assert [h.started_at for h in again] == [1005.0, None, None]
                assert [h.workflow_id for h in await store.hooks_pending(after=again[0].id)] == [
                    "b",
                    "c",
                ]
                assert len(await store.hooks_pending(limit=1)) == 1
                await store.hooks_done([again[0].id, again[2].id])
                assert [h.workflow_id for h in await store.hooks_pending()] == ["b"]
                # A retried workflow that fails again is a new ending with a new key.
                await store.set_status("b", status="Waiting")
                await store.set_status("b", status="Failed", error="y")
                ids = [h.id for h in await store.hooks_pending()]
        assert len(ids) == 2 and ids[1] > max(h.id for h in again)

    async def test_a_rolled_back_ending_queues_nothing(self, opener: Opener) -> None:
        """A status write that fails (its workflow is gone) leaves the queue as it was."""
        async with opener() as store:
            with pytest.raises(WorkflowNotFound):
                await store.set_status("ghost", status="Failed", error="x")
            assert await store.hooks_pending() == []


class TestGauges:
    async def test_counts_by_type_and_inbox_depth(self, opener: Opener) -> None:
        """`/metrics` gauges: workflows per (type, status) and acknowledged events not applied."""
        async with opener() as store:
            await store.create(row("a", "Waiting", name="X"))
            await store.create(row("b", "Waiting", name="X"))
            await store.create(row("c", "Finished", name="Y"))
            assert await store.inbox_depth() == 0
            ids = [await store.inbox_put("a", "go", None) for _ in range(3)]
            await store.inbox_done(ids[:1])
            assert await store.counts_by_type() == {("X", "Waiting"): 2, ("Y", "Finished"): 1}
            assert await store.inbox_depth() == 2


class TestCommitMetrics:
    async def test_each_group_commit_is_timed_and_sized(self, opener: Opener) -> None:
        """The writer notes every group commit: its duration and how many writes it held."""
        metrics = Metrics()
        async with opener(metrics=metrics) as store:
            await store.create(row("a"))
            async with anyio.create_task_group() as tg:
                for n in range(5):
                    tg.start_soon(store.inbox_put, "a", f"e{n}", None)
        found = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples
        }
        commits = found[("workflowd_commit_duration_seconds_count", frozenset())]
        assert 2 <= commits <= 6
        assert found[("workflowd_commit_batch_size_sum", frozenset())] == 6
        assert found[("workflowd_commit_duration_seconds_sum", frozenset())] > 0
