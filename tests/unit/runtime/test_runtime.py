"""Tests for the runtime: real SQLite store, real handlers, a fake clock for timers."""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import msgspec
import pytest

from daemon import (
    CallbackNotFound,
    CallbackRequest,
    For,
    Go,
    NonRetryableError,
    On,
    Retry,
    S,
    Section,
    Step,
    Wait,
    Workflow,
)
from daemon.clock import FakeClock
from daemon.core.state import State
from daemon.errors import (
    BadRequest,
    Conflict,
    HandlerRejected,
    UnknownWorkflowType,
    WorkflowNotFound,
)
from daemon.runtime.runtime import CreateMany, Runtime
from daemon.runtime.settings import Settings
from daemon.store.base import History, WorkflowRow
from daemon.store.sqlite import SQLiteStore
from handlers import Signal, Timer
from tests.helpers.wait import eventually, until, wait_runtime_status


@dataclass
class Counter(Workflow):
    """Counts to `upto` in a loop, one step per increment."""

    upto: int = 5
    i: int = 0

    def definition(self) -> Section:
        return S(
            For("loop", self.i < self.upto, Step("inc", lambda: setattr(self, "i", self.i + 1)))
        )


@dataclass
class Approval(Workflow):
    """Waits for a decision or a timeout."""

    decision: str = ""
    log: list[str] = field(default_factory=list)

    def decide(self, input: dict[str, Any]) -> str:
        if input.get("by") == "mallory":
            raise ValueError("mallory may not decide")
        self.decision = str(input["decision"])
        return f"recorded {self.decision}"

    def definition(self) -> Section:
        return S(
            Step("ask", lambda: self.log.append("asked")),
            Wait(
                "decide",
                On(
                    "decision",
                    Signal(self.decide),
                    Step("apply", lambda: self.log.append("applied")),
                ),
                On(
                    "timeout", Timer(after=3600), Step("expire", lambda: self.log.append("expired"))
                ),
            ),
        )


FAILS: dict[str, int] = {}


@dataclass
class Flaky(Workflow):
    """A step that fails `fail_times` times before it succeeds."""

    key: str = ""
    fail_times: int = 2
    fatal: bool = False
    done: bool = False

    def act(self) -> None:
        FAILS[self.key] = FAILS.get(self.key, 0) + 1
        if self.fatal:
            raise NonRetryableError("no point retrying")
        if FAILS[self.key] <= self.fail_times:
            raise RuntimeError(f"flake {FAILS[self.key]}")
        self.done = True

    def definition(self) -> Section:
        return S(Step("flaky", self.act, retry=Retry(initial_s=10, max_attempts=4)))


@dataclass
class Parallel(Workflow):
    """A worker thread waits for its own signal while main waits for another."""

    got: list[str] = field(default_factory=list)

    def definition(self) -> Section:
        return S(
            Go(
                "worker",
                S(Wait("w", On("work", Signal())), Step("w_done", lambda: self.got.append("w"))),
            ),
            Wait("m", On("finish", Signal())),
            Step("m_done", lambda: self.got.append("m")),
        )


@dataclass
class Broken(Workflow):
    """A Wait given a Step where an On belongs."""

    def definition(self) -> Section:
        return S(Wait("w", Step("oops", print)))  # type: ignore[arg-type]


@dataclass
class Sleeper(Workflow):
    """One async step that sleeps an hour: a run still in its step."""

    async def nap(self) -> None:
        await anyio.sleep(3600)

    def definition(self) -> Section:
        return S(Step("nap", self.nap))


@dataclass
class Tokened(Workflow):
    """Gets a token of its own when it is made (a default that differs per instance)."""

    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def definition(self) -> Section:
        return S(Step("noop", lambda: None))


REGISTRY: dict[str, type[Workflow]] = {
    c.name: c for c in (Counter, Approval, Flaky, Parallel, Broken, Sleeper, Tokened)
}


@asynccontextmanager
async def running(
    db: Path, clock: FakeClock | None = None, **settings: Any
) -> AsyncIterator[Runtime]:
    """Open a store and a runtime on it for the body of the block."""
    async with (
        SQLiteStore.open(db) as store,
        Runtime.open(store, REGISTRY, Settings(**settings), clock=clock or FakeClock()) as rt,
    ):
        yield rt


class TestStart:
    """Starting workflows."""

    async def test_runs_to_finish(self, tmp_path: Path) -> None:
        """A started workflow runs every step and finishes, with history."""
        async with running(tmp_path / "wf.db") as rt:
            res = await rt.start("Counter", "c1", {"upto": 3})
            assert res["workflow_id"] == "c1"
            shown = await wait_runtime_status(rt, "c1", "Finished")
            assert shown["data"] == {"upto": 3, "i": 3}
            kinds = [h["kind"] for h in await rt.history("c1")]
            assert kinds.count("step_done") == 3
            assert kinds[0] == "started"

    async def test_defaults_are_stored(self, tmp_path: Path) -> None:
        """Fields left at their defaults are written to the store, not left implicit."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Approval", "a1", {})
            row = await rt.store.get("a1")
            assert row is not None
            # The workflow may have run its first step by now (log: ["asked"]); what matters is
            # that every field is in the row, not left implicit.
            data = msgspec.json.decode(row.data)
            assert data["decision"] == "" and isinstance(data["log"], list)

    async def test_idempotent_and_conflict(self, tmp_path: Path) -> None:
        """Starting an existing id returns it; a different type is a conflict."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Counter", "same")
            again = await rt.start("Counter", "same")
            assert again["created"] is False
            with pytest.raises(Conflict):
                await rt.start("Approval", "same")

    async def test_unknown_type_and_bad_input(self, tmp_path: Path) -> None:
        """Unknown workflow types and unknown input fields are clear errors that store nothing."""
        async with running(tmp_path / "wf.db") as rt:
            with pytest.raises(UnknownWorkflowType, match="Nope"):
                await rt.start("Nope")
            with pytest.raises(Exception, match="no field"):
                await rt.start("Counter", "x", {"bogus": 1})
            assert await rt.list() == []


def create_each(store: SQLiteStore) -> CreateMany:
    """Return a `start_many` writer that creates each row on its own."""

    async def create(rows: Sequence[tuple[WorkflowRow, History]]) -> list[bool]:
        return [await store.create(row, history) for row, history in rows]

    return create


class TestStartMany:
    """Starting many workflows with one write (a batch of schedule fires)."""

    async def test_each_runs_on_its_own_data(self, tmp_path: Path) -> None:
        """Starts sharing one input each get their own data; a bad one or an existing id gets
        its own answer and the others run to the end."""
        shared = {"upto": 3}
        async with running(tmp_path / "wf.db") as rt:
            assert isinstance(rt.store, SQLiteStore)
            await rt.start("Counter", "old")
            starts: list[tuple[str, str, dict[str, Any] | None]] = [
                *((("Counter", f"c{i}", shared)) for i in range(20)),
                ("Counter", "none", None),
                ("Counter", "bad", {"bogus": 1}),
                ("Nope", "nope", None),
                ("Counter", "old", shared),
            ]
            out = await rt.start_many(starts, create=create_each(rt.store))
            assert [r["created"] for r in out[:21] if isinstance(r, dict)] == [True] * 21
            assert isinstance(out[21], BadRequest) and isinstance(out[22], UnknownWorkflowType)
            old = out[23]
            assert isinstance(old, dict) and old["created"] is False and old["workflow_id"] == "old"
            for i in range(20):
                shown = await wait_runtime_status(rt, f"c{i}", "Finished")
                assert shown["data"] == {"upto": 3, "i": 3}
            assert (await wait_runtime_status(rt, "none", "Finished"))["data"]["i"] == 5
            assert shared == {"upto": 3}
            assert await rt.store.get("bad") is None and await rt.store.get("nope") is None

    async def test_defaults_made_per_instance_stay_so(self, tmp_path: Path) -> None:
        """A field whose default is made per instance (a token) differs between the starts."""
        async with running(tmp_path / "wf.db") as rt:
            assert isinstance(rt.store, SQLiteStore)
            starts = [("Tokened", f"t{i}", None) for i in range(10)]
            await rt.start_many(starts, create=create_each(rt.store))
            tokens = {
                (await wait_runtime_status(rt, f"t{i}", "Finished"))["data"]["token"]
                for i in range(10)
            }
            assert len(tokens) == 10

    async def test_held(self, tmp_path: Path) -> None:
        """Under `--hold` the batch's workflows are created and parked, not run."""
        async with running(tmp_path / "wf.db", hold=True) as rt:
            assert isinstance(rt.store, SQLiteStore)
            starts = [("Counter", f"h{i}", None) for i in range(5)]
            await rt.start_many(starts, create=create_each(rt.store))
            assert set(rt.scheduler.hold.parked) == {f"h{i}" for i in range(5)}
            assert len(rt.scheduler) == 0
            assert {r["status"] for r in await rt.list()} == {"Resuming"}

    async def test_stop_with_the_batch_in_its_steps(self, tmp_path: Path) -> None:
        """A runtime stops at once while the runs of a batch are in their steps."""
        with anyio.fail_after(10):
            async with running(tmp_path / "wf.db") as rt:
                assert isinstance(rt.store, SQLiteStore)
                starts = [("Sleeper", f"s{i}", None) for i in range(50)]
                await rt.start_many(starts, create=create_each(rt.store))

                async def all_napping() -> bool:
                    return rt.busy() == 50

                await eventually(all_napping)
            async with running(tmp_path / "wf.db") as rt:
                # Recovered: each is resumed again, its step running once more.
                await eventually(all_napping)

    async def test_prepared_rows_are_what_a_start_writes(self, tmp_path: Path) -> None:
        """Rows built ahead for one type and input (copies of the first) hold what building
        each start alone gives, for ids JSON must escape too; they are stamped at the write."""
        ids = ["plain", 'quo"te', "back\\slash", "ünï", "main", "Counter", "ctl\x01"]
        async with running(tmp_path / "wf.db") as rt:
            assert isinstance(rt.store, SQLiteStore)
            made = rt.prepare_many([("Counter", wid, {"upto": 2}) for wid in ids])
            await anyio.sleep(0.01)
            written, rows = time.time(), list[WorkflowRow]()

            async def create(batch: Sequence[tuple[WorkflowRow, History]]) -> list[bool]:
                rows.extend(row for row, _ in batch)
                assert isinstance(rt.store, SQLiteStore)
                return await create_each(rt.store)(batch)

            await rt.launch_many([m for m in made if not isinstance(m, Exception)], create=create)
            assert [r.id for r in rows] == ids
            for row in rows:
                assert row.state == State.new(row.id, "Counter").to_json()
                assert row.data == Counter.from_input({"upto": 2}).to_json()
                assert row.created_at >= written and row.updated_at >= written
            for wid in ids:
                assert (await wait_runtime_status(rt, wid, "Finished"))["data"]["i"] == 2


class TestCallbacks:
    """Callbacks reach the waiting thread and are durable when acknowledged."""

    async def test_signal_then_finish(self, tmp_path: Path) -> None:
        """A signal's reply comes back and the workflow runs its case."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Approval", "a1")
            out = await rt.send("a1", "decision", {"decision": "yes"})
            assert out == "recorded yes"
            shown = await wait_runtime_status(rt, "a1", "Finished")
            assert shown["data"]["log"] == ["asked", "applied"]

    async def test_send_right_after_start_does_not_race(self, tmp_path: Path) -> None:
        """A callback sent before the workflow blocks waits in its queue."""
        async with running(tmp_path / "wf.db") as rt:
            for n in range(20):
                await rt.start("Approval", f"r{n}")
                assert await rt.send(f"r{n}", "decision", {"decision": "ok"}) == "recorded ok"

    async def test_send_now_answers_through_its_reply(self, tmp_path: Path) -> None:
        """`send_now` queues the send of a workflow in memory; else it leaves it to `send`."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Approval", "a1")
            await wait_runtime_status(rt, "a1", "Waiting")
            assert rt.send_now("zzz", "decision") is None  # not in memory: `send` reads it
            with pytest.raises(WorkflowNotFound):
                await rt.send("zzz", "decision")  # ... which says what is wrong
            reply = rt.send_now("a1", "decision", {"decision": "yes"})
            assert reply is not None
            assert await reply.wait() == "recorded yes"
            await wait_runtime_status(rt, "a1", "Finished")
            with pytest.raises(CallbackNotFound):
                rt.send_now("a1", "decision", {"decision": "again"})

    async def test_rejections_change_nothing(self, tmp_path: Path) -> None:
        """Unknown workflow, unknown event and a raising handler are errors; data is unchanged."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Approval", "a1")
            with pytest.raises(WorkflowNotFound):
                await rt.send("zzz", "decision", {})
            with pytest.raises(CallbackNotFound):
                await rt.send("a1", "nope")
            before = await rt.show("a1")
            with pytest.raises(HandlerRejected, match="mallory"):
                await rt.send("a1", "decision", {"by": "mallory", "decision": "x"})
            after = await rt.show("a1")
            assert after["data"] == before["data"] and after["state"] == before["state"]
            assert after["status"] == "Waiting"

    async def test_no_wait_send_is_durable(self, tmp_path: Path) -> None:
        """A queued send is stored in the inbox and applied even across a restart."""
        db = tmp_path / "wf.db"
        async with running(db) as rt:
            await rt.start("Approval", "a1")
            await wait_runtime_status(rt, "a1", "Waiting")
        async with SQLiteStore.open(db) as store:
            await store.inbox_put("a1", "decision", {"decision": "later"})
        async with running(db) as rt:
            shown = await wait_runtime_status(rt, "a1", "Finished")
            assert shown["data"]["decision"] == "later"
            assert await rt.store.inbox_pending() == []

    async def test_threads(self, tmp_path: Path) -> None:
        """Each thread gets its own event; main finishing ends the workflow."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Parallel", "p")
            await wait_runtime_status(rt, "p", "Waiting")
            assert sorted((await rt.list())[0]["waiting_for"]) == ["finish", "work"]
            await rt.send("p", "work")
            await rt.send("p", "finish")
            shown = await wait_runtime_status(rt, "p", "Finished")
            assert shown["data"]["got"] == ["w", "m"]


class TestTimers:
    """Timers fire through the runtime's heap."""

    async def test_timer_fires_and_tears_down_signal(self, tmp_path: Path) -> None:
        """The timeout case fires when the fake clock passes its deadline."""
        clock = FakeClock()
        async with running(tmp_path / "wf.db", clock) as rt:
            await rt.start("Approval", "a1")
            await wait_runtime_status(rt, "a1", "Waiting")
            assert len(rt.arms) == 1
            clock.advance(3601)
            shown = await wait_runtime_status(rt, "a1", "Finished")
            assert shown["data"]["log"] == ["asked", "expired"]
            assert len(rt.arms) == 0
            with pytest.raises(CallbackNotFound):
                await rt.send("a1", "decision", {"decision": "late"})

    async def test_timer_due_while_down_fires_on_restart(self, tmp_path: Path) -> None:
        """A deadline that passed while the daemon was down fires at once on restart."""
        db = tmp_path / "wf.db"
        clock = FakeClock()
        async with running(db, clock) as rt:
            await rt.start("Approval", "a1")
            await wait_runtime_status(rt, "a1", "Waiting")
        clock.advance(7200)
        async with running(db, clock) as rt:
            shown = await wait_runtime_status(rt, "a1", "Finished")
            assert shown["data"]["log"] == ["asked", "expired"]


class TestRetry:
    """Failing steps are retried with backoff, then fail for good."""

    async def test_retries_then_succeeds(self, tmp_path: Path) -> None:
        """A flaky step is retried after its backoff and the error is recorded meanwhile."""
        clock = FakeClock()
        FAILS.clear()
        async with running(tmp_path / "wf.db", clock) as rt:
            await rt.start("Flaky", "f", {"key": "a", "fail_times": 2})

            async def failed_once() -> bool:
                return bool((await rt.show("f"))["attempt"] == 1)

            await eventually(failed_once)
            assert "flake 1" in (await rt.show("f"))["error"]
            assert FAILS["a"] == 1

            async def advanced() -> bool:
                clock.advance(5)
                return FAILS["a"] >= 3

            await eventually(advanced)
            shown = await wait_runtime_status(rt, "f", "Finished")
            assert shown["data"]["done"] is True
            failed = [h for h in await rt.history("f") if h["kind"] == "step_failed"]
            assert [h["attempt"] for h in failed] == [1, 2]

    async def test_no_finished_checkpoint_keeps_the_retry_error(self, tmp_path: Path) -> None:
        """Every checkpoint of a Finished workflow is clean, also the first one after a retry.

        The engine writes Finished before the actor's last save; a daemon killed between the
        two must not leave a Finished workflow with its retried step's error for good.
        """
        clock = FakeClock()
        FAILS.clear()
        written: list[tuple[str, str | None]] = []
        async with SQLiteStore.open(tmp_path / "wf.db") as store:
            checkpoint = store.checkpoint

            async def recorded(workflow_id: str, **fields: Any) -> Any:
                written.append((fields["status"], fields["error"]))
                return await checkpoint(workflow_id, **fields)

            store.checkpoint = recorded  # type: ignore[method-assign]
            async with Runtime.open(store, REGISTRY, Settings(), clock=clock) as rt:
                await rt.start("Flaky", "f", {"key": "b", "fail_times": 1})

                async def retried() -> bool:
                    clock.advance(5)
                    return FAILS.get("b", 0) >= 2

                await eventually(retried)
                await wait_runtime_status(rt, "f", "Finished")
        finished = [error for status, error in written if status == "Finished"]
        assert finished and finished == [None] * len(finished)

    async def test_fails_after_max_attempts(self, tmp_path: Path) -> None:
        """After max_attempts the workflow is Failed with the error kept."""
        clock = FakeClock()
        FAILS.clear()
        async with running(tmp_path / "wf.db", clock) as rt:
            await rt.start("Flaky", "f", {"key": "b", "fail_times": 99})
            with anyio.fail_after(10):
                while (await rt.show("f"))["status"] != "Failed":
                    clock.advance(100)
                    await anyio.sleep(0.01)
            shown = await rt.show("f")
            assert FAILS["b"] == 4
            assert "flake 4" in shown["error"]

    async def test_non_retryable_fails_at_once(self, tmp_path: Path) -> None:
        """A NonRetryableError fails the workflow without a retry."""
        FAILS.clear()
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Flaky", "f", {"key": "c", "fatal": True})
            shown = await wait_runtime_status(rt, "f", "Failed")
            assert FAILS["c"] == 1
            assert "no point retrying" in shown["error"]


class TestCancel:
    """Cancelling tears everything down."""

    async def test_cancel_waiting(self, tmp_path: Path) -> None:
        """A waiting workflow is cancelled, its timer disarmed, and later sends are refused."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Approval", "a1")
            await wait_runtime_status(rt, "a1", "Waiting")
            res = await rt.cancel("a1")
            assert res["status"] == "Cancelled"
            assert len(rt.arms) == 0
            shown = await rt.show("a1")
            assert shown["status"] == "Cancelled"
            assert shown["state"]["threads"] == [] or all(
                not t["wait_events"] for t in shown["state"]["threads"]
            )
            with pytest.raises(CallbackNotFound):
                await rt.send("a1", "decision", {"decision": "x"})

    async def test_cancel_during_retry_wait(self, tmp_path: Path) -> None:
        """A workflow waiting to retry a step is cancelled at once."""
        FAILS.clear()
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Flaky", "f", {"key": "d", "fail_times": 99})

            async def failed() -> bool:
                return FAILS.get("d", 0) >= 1

            await eventually(failed)
            assert (await rt.cancel("f"))["status"] == "Cancelled"
            await rt.wait_idle()
            assert (await rt.show("f"))["status"] == "Cancelled"

    async def test_cancel_during_a_repair_is_applied_after(self, tmp_path: Path) -> None:
        """A cancel that arrives while a repair holds the workflow is answered once it ends."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Approval", "a1")
            await wait_runtime_status(rt, "a1", "Waiting")
            answers: list[dict[str, Any]] = []

            async def cancel() -> None:
                answers.append(await rt.cancel("a1"))

            async with anyio.create_task_group() as tg:
                async with rt.scheduler.exclusive("a1"):
                    tg.start_soon(cancel)
                    await until(lambda: bool(rt.scheduler.hold.parked.get("a1")))
                with anyio.fail_after(5):
                    await wait_runtime_status(rt, "a1", "Cancelled")
            assert answers == [{"workflow_id": "a1", "status": "Cancelled"}]


class TestRecovery:
    """Restarts lose nothing and corrupt rows are skipped."""

    async def test_waiting_survives_restart(self, tmp_path: Path) -> None:
        """A waiting workflow accepts its signal after a restart."""
        db = tmp_path / "wf.db"
        async with running(db) as rt:
            await rt.start("Approval", "a1")
            await wait_runtime_status(rt, "a1", "Waiting")
        async with running(db) as rt:
            assert await rt.send("a1", "decision", {"decision": "late"}) == "recorded late"
            await wait_runtime_status(rt, "a1", "Finished")

    async def test_corrupt_row_skipped(self, tmp_path: Path) -> None:
        """A row with invalid JSON is held with the reason; the others are served."""
        db = tmp_path / "wf.db"
        async with running(db) as rt:
            await rt.start("Approval", "bad")
            await rt.start("Approval", "good")
            await wait_runtime_status(rt, "good", "Waiting")
            await wait_runtime_status(rt, "bad", "Waiting")
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE workflows SET state = '{not json' WHERE id = 'bad'")
        async with running(db) as rt:
            assert (await rt.show("bad"))["incompatible"].startswith("corrupt row")
            assert await rt.send("good", "decision", {"decision": "y"}) == "recorded y"
            with pytest.raises(Conflict, match="corrupt"):
                await rt.send("bad", "decision", {"decision": "y"})

    async def test_inbox_event_for_an_ended_workflow_is_dropped(self, tmp_path: Path) -> None:
        """An inbox row left for a finished workflow is rejected once, recorded and deleted."""
        db = tmp_path / "wf.db"
        async with running(db) as rt:
            await rt.start("Counter", "c", {"upto": 1})
            await wait_runtime_status(rt, "c", "Finished")
            await rt.store.inbox_put("c", "late", {"x": 1})
        async with running(db) as rt:

            async def drained() -> bool:
                return not await rt.store.inbox_pending()

            await eventually(drained)
            await rt.wait_idle()
            kinds = [h["kind"] for h in await rt.history("c")]
            assert kinds.count("callback_rejected") == 1
            assert (await rt.show("c"))["status"] == "Finished"

    async def test_invalid_definition_fails_workflow(self, tmp_path: Path) -> None:
        """A definition that does not validate fails the workflow with the reason."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Broken", "b")
            shown = await wait_runtime_status(rt, "b", "Failed")
            assert "cases must be On" in shown["error"]

    async def test_group_commit_under_concurrency(self, tmp_path: Path) -> None:
        """Many workflows stepping together share commits."""
        async with running(tmp_path / "wf.db") as rt:
            for n in range(50):
                await rt.start("Counter", f"c{n}", {"upto": 10})
            for n in range(50):
                await wait_runtime_status(rt, f"c{n}", "Finished")
            assert isinstance(rt.store, SQLiteStore)
            assert rt.store.stats.commits < rt.store.stats.writes


class TestReservedFields:
    """Data fields cannot hide Workflow's own attributes."""

    def test_field_called_name_rejected(self) -> None:
        """A field called `name` would hide the registered name, so it is refused at once."""
        from daemon.errors import ValidationError

        with pytest.raises(ValidationError, match="may not be called 'name'"):

            @dataclass
            class Named(Workflow):
                name: str = "x"  # type: ignore[misc]

                def definition(self) -> Section:
                    return S()


class Sticky:
    """A handler whose teardown fails while `broken` is set (a resource it cannot release yet)."""

    type = "sticky"
    broken: ClassVar[bool] = True
    teardowns: ClassVar[list[str]] = []

    async def setup(self, req: CallbackRequest) -> str:
        """Arm nothing."""
        return ""

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Echo the input."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Fail while broken, else record the release."""
        if Sticky.broken:
            raise OSError("resource busy")
        Sticky.teardowns.append(req.name)


@dataclass
class Leaves(Workflow):
    """A worker waits on a Sticky event while main finishes, so the worker's wait is torn down."""

    done: bool = False

    def definition(self) -> Section:
        return S(
            Go("worker", S(Wait("w", On("never", Sticky())))),
            Wait("m", On("finish", Signal())),
            Step("end", lambda: setattr(self, "done", True)),
        )


REGISTRY[Leaves.name] = Leaves


class TestTeardownRetry:
    """A teardown that failed when a workflow ended is retried until it succeeds."""

    async def test_failed_teardown_retried_by_janitor(self, tmp_path: Path) -> None:
        """The failure is recorded on the ended workflow, then the janitor releases it."""
        Sticky.broken, Sticky.teardowns = True, []
        db = tmp_path / "wf.db"
        async with running(db) as rt:
            await rt.start("Leaves", "l")
            await wait_runtime_status(rt, "l", "Waiting")
            await rt.send("l", "finish")
            shown = await wait_runtime_status(rt, "l", "Finished")
            (thread,) = shown["state"]["threads"]
            assert thread["wait_events"][0]["status"] == "TeardownError"
            assert await rt.janitor.sweep() == 1  # still broken: kept, counted
            Sticky.broken = False
            assert await rt.janitor.sweep() == 0
            assert Sticky.teardowns == ["never"]
            assert (await rt.show("l"))["state"]["threads"] == []
            retried = [h for h in await rt.history("l") if h["kind"] == "teardown_retried"]
            assert retried[0]["still_failing"] == 1 and retried[-1]["still_failing"] == 0

    async def test_retried_after_restart(self, tmp_path: Path) -> None:
        """A failed teardown left by an earlier run is retried when the runtime starts."""
        Sticky.broken, Sticky.teardowns = True, []
        db = tmp_path / "wf.db"
        async with running(db) as rt:
            await rt.start("Leaves", "l")
            await wait_runtime_status(rt, "l", "Waiting")
            await rt.send("l", "finish")
            await wait_runtime_status(rt, "l", "Finished")
        Sticky.broken = False
        async with running(db) as rt:

            async def released() -> bool:
                return bool((await rt.show("l"))["state"]["threads"] == [])

            await eventually(released)
        assert Sticky.teardowns == ["never"]
