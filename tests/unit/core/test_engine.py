"""Tests for the engine: resume, callbacks, waits, threads and the seed's defects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest

from daemon import (
    MAIN_THREAD,
    Break,
    CallbackNotFound,
    CallbackRequest,
    Case,
    CheckpointType,
    Continue,
    Default,
    EventStatus,
    For,
    Go,
    HandlerRejected,
    If,
    On,
    Return,
    RunawayWorkflow,
    S,
    Section,
    StaleCallback,
    State,
    Step,
    StepFailed,
    StepNotFound,
    Switch,
    ThreadStatus,
    ValidationError,
    Wait,
    WaitFor,
    Workflow,
    WorkflowStatus,
    definition_to_dict,
    handle_callback,
    resume,
    validate,
)
from daemon.core.engine import Done, Start, call_action
from daemon.core.merge import Fork
from tests.helpers.support import Driver, Recorder


@dataclass
class Linear(Workflow):
    """Three steps in a row."""

    log: list[str] = field(default_factory=list)

    def definition(self) -> Section:
        return S(
            Step("a", lambda: self.log.append("a")),
            Step("b", lambda: self.log.append("b")),
            Step("c", lambda: self.log.append("c")),
        )


class TestResume:
    """Resuming runs steps in order and checkpoints each transition."""

    async def test_runs_steps_in_order_and_finishes(self) -> None:
        """Every step runs once, in order, and the workflow finishes."""
        d = Driver(Linear())
        await d.resume()
        assert d.wf.log == ["a", "b", "c"]
        assert d.state.status is WorkflowStatus.FINISHED
        assert d.checkpoints.count(CheckpointType.AFTER_STEP) == 3
        assert CheckpointType.AFTER_RESUME in d.checkpoints

    async def test_async_actions_are_awaited(self) -> None:
        """An async step action is awaited."""

        @dataclass
        class Async(Workflow):
            done: bool = False

            def definition(self) -> Section:
                async def act() -> None:
                    self.done = True

                return S(Step("act", act))

        d = Driver(Async())
        await d.resume()
        assert d.wf.done

    async def test_finished_workflow_cannot_resume(self) -> None:
        """Resuming a finished workflow is an error."""
        d = Driver(Linear())
        await d.resume()
        with pytest.raises(Exception, match="already Finished"):
            await d.resume()

    async def test_checkpointed_step_never_runs_again(self) -> None:
        """Restarting from any checkpoint re-runs no step whose completion was checkpointed."""
        runs: list[str] = []

        @dataclass
        class Counting(Workflow):
            n: int = 0

            def definition(self) -> Section:
                def bump(name: str) -> Any:
                    def act() -> None:
                        runs.append(name)
                        self.n += 1

                    return act

                return S(
                    For("loop", self.n < 3, Step("inc", bump("inc"))), Step("end", bump("end"))
                )

        snapshots: list[tuple[str, str]] = []
        wf = Counting()
        state = State.new("x", "Counting")

        async def save(kind: CheckpointType) -> None:
            snapshots.append((wf.to_json(), state.to_json()))

        await resume(wf, state, save)
        assert runs == ["inc", "inc", "inc", "end"]
        for data, st in snapshots:
            runs.clear()
            wf2, state2 = Counting.from_json(data), State.from_json(st)
            if state2.status is WorkflowStatus.FINISHED:
                continue
            await resume(wf2, state2, save)
            assert wf2.n == 4
            assert len(runs) == 4 - Counting.from_json(data).n


class TestBranches:
    """If, elif, else and Switch take the first true branch."""

    @pytest.mark.parametrize(("x", "want"), [(1, "one"), (2, "two"), (9, "other")])
    async def test_if_elif_else(self, x: int, want: str) -> None:
        """The first true branch runs, else the else branch."""

        @dataclass
        class Pick(Workflow):
            x: int = 0
            got: str = ""

            def definition(self) -> Section:
                def set_(v: str) -> Step:
                    return Step(f"set_{v}", lambda: setattr(self, "got", v))

                return S(
                    If(self.x == 1, "is_one", set_("one"))
                    .elif_(self.x == 2, "is_two", set_("two"))
                    .else_("is_other", set_("other"))
                )

        d = Driver(Pick(x=x))
        await d.resume()
        assert d.wf.got == want

    async def test_switch_default(self) -> None:
        """A Switch falls back to Default when no case holds."""

        @dataclass
        class Sw(Workflow):
            got: str = ""

            def definition(self) -> Section:
                return S(
                    Switch(
                        Case(False, "no", Step("no_step", lambda: setattr(self, "got", "no"))),
                        Case(lambda: False, "no2", Step("no2_step", lambda: None)),
                        Default("dflt", Step("d_step", lambda: setattr(self, "got", "default"))),
                    )
                )

        d = Driver(Sw())
        await d.resume()
        assert d.wf.got == "default"


@dataclass
class Loops(Workflow):
    """A For with Continue and Break, each of which must skip the rest of the body."""

    i: int = 0
    seen: list[int] = field(default_factory=list)

    def definition(self) -> Section:
        return S(
            For(
                "loop",
                self.i < 10,
                Step("inc", lambda: setattr(self, "i", self.i + 1)),
                If(self.i % 2 == 1, "odd", Continue()),
                If(self.i >= 6, "enough", Break()),
                Step("record", lambda: self.seen.append(self.i)),
            ),
            Step("after", lambda: self.seen.append(-1)),
        )


class TestLoops:
    """For, Break and Continue."""

    async def test_continue_and_break_skip_rest_of_body(self) -> None:
        """Continue skips to the next iteration and Break leaves the loop (seed defects 1, 2)."""
        d = Driver(Loops())
        await d.resume()
        assert d.wf.seen == [2, 4, -1]
        assert d.wf.i == 6

    async def test_runaway_guard(self) -> None:
        """A loop that never blocks fails with a clear error after the transition limit."""

        @dataclass
        class Spin(Workflow):
            def definition(self) -> Section:
                return S(For("spin", True, If(False, "never", Return())))

        with pytest.raises(RunawayWorkflow, match="endless loop"):
            await Driver(Spin()).resume()

    async def test_return_finishes_workflow(self) -> None:
        """Return in the main thread finishes the workflow and skips the rest."""

        @dataclass
        class Ret(Workflow):
            log: list[str] = field(default_factory=list)

            def definition(self) -> Section:
                return S(
                    Step("one", lambda: self.log.append("one")),
                    Return(),
                    Step("two", lambda: self.log.append("two")),
                )

        d = Driver(Ret())
        await d.resume()
        assert d.wf.log == ["one"]
        assert d.state.status is WorkflowStatus.FINISHED


@dataclass
class Approval(Workflow):
    """Waits for approve or reject, twice around a loop."""

    rounds: int = 0
    log: list[str] = field(default_factory=list)

    def definition(self) -> Section:
        return S(
            For(
                "rounds",
                self.rounds < 2,
                Wait(
                    "decide",
                    On("approve", REC, Step("approved", lambda: self.log.append("yes"))),
                    On("reject", REC, Step("rejected", lambda: self.log.append("no"))),
                ),
                Step("count", lambda: setattr(self, "rounds", self.rounds + 1)),
            )
        )


REC = Recorder()


class TestWait:
    """Wait blocks, sets up its cases, runs the fired case and tears down the others."""

    @pytest.fixture(autouse=True)
    def _reset(self) -> None:
        REC.calls.clear()
        REC.fail_handle = REC.fail_setup = REC.fail_teardown = False

    async def test_setup_fire_teardown(self) -> None:
        """Setup runs after the thread blocks; teardown runs for every case, flagging the fired one."""
        d = Driver(Approval())
        await d.resume()
        main = d.state.threads[0]
        assert d.state.status is WorkflowStatus.WAITING
        assert main.status is ThreadStatus.WAITING_EVENT
        assert [e.status for e in main.wait_events] == [EventStatus.SETUP] * 2
        assert main.wait_events[0].req.setup_data == '{"armed": "approve"}'
        assert REC.calls == [("setup", "approve"), ("setup", "reject")]
        assert CheckpointType.AFTER_SETUP in d.checkpoints
        out = await d.send("approve", {"by": "ann"})
        assert out == {"echo": {"by": "ann"}}
        assert ("teardown_handled", "approve") in REC.calls
        assert ("teardown", "reject") in REC.calls
        assert CheckpointType.AFTER_TEARDOWN in d.checkpoints
        assert d.wf.log == ["yes"]
        await d.send("reject")
        assert d.wf.log == ["yes", "no"]
        assert d.state.status == WorkflowStatus.FINISHED  # type: ignore[comparison-overlap]

    async def test_stale_pc_rejected(self) -> None:
        """A callback carrying the pc of an earlier iteration's wait is rejected."""
        d = Driver(Approval())
        await d.resume()
        old_pc = d.state.threads[0].wait_events[0].req.pc
        await d.send("approve", pc=old_pc)
        with pytest.raises(StaleCallback):
            await handle_callback(CallbackRequest(name="approve", pc=old_pc), d.wf, d.state, None)
        new_pc = d.state.threads[0].wait_events[0].req.pc
        assert new_pc != old_pc
        await d.send("approve", pc=new_pc)
        assert d.wf.log == ["yes", "yes"]

    async def test_unknown_event_not_found(self) -> None:
        """A callback for an event nobody waits for is not found."""
        d = Driver(Approval())
        await d.resume()
        with pytest.raises(CallbackNotFound):
            await d.send("nope")

    async def test_handler_error_changes_nothing(self) -> None:
        """A handler that raises leaves data and state exactly as before."""

        @dataclass
        class Mutating(Workflow):
            n: int = 0

            def definition(self) -> Section:
                wf = self

                class Breaks(Recorder):
                    async def handle(self, req: CallbackRequest, input: Any) -> Any:
                        wf.n = 99
                        raise ValueError("rejected")

                return S(Wait("w", On("go", Breaks())))

        d = Driver(Mutating())
        await d.resume()
        before = (d.wf.to_json(), d.state.to_json())
        with pytest.raises(HandlerRejected, match="rejected"):
            await handle_callback(CallbackRequest(name="go"), d.wf, d.state, 1)
        assert (d.wf.to_json(), d.state.to_json()) == before

    async def test_setup_error_recorded_and_retried(self) -> None:
        """A setup that raises is recorded on the wait and retried on the next resume."""
        REC.fail_setup = True
        d = Driver(Approval())
        await d.resume()
        events = d.state.threads[0].wait_events
        assert {e.status for e in events} == {EventStatus.SETUP_ERROR}
        assert "setup broke" in events[0].error
        REC.fail_setup = False
        await d.resume()
        assert {e.status for e in events} == {EventStatus.SETUP}
        assert events[0].error == ""

    async def test_teardown_error_recorded_and_retried(self) -> None:
        """A teardown that raises is recorded and retried on the next resume."""
        d = Driver(Approval())
        await d.resume()
        REC.fail_teardown = True
        await d.send("approve")
        errs = [e for e in d.state.threads[0].wait_events if e.status is EventStatus.TEARDOWN_ERROR]
        assert len(errs) == 2
        REC.fail_teardown = False
        await d.resume()
        assert all(e.status is EventStatus.SETUP for e in d.state.threads[0].wait_events)

    async def test_teardown_checkpoint_error_propagates(self) -> None:
        """A checkpoint failing during teardown is raised, not swallowed (seed defect 6)."""
        d = Driver(Approval())
        await d.resume()
        await handle_callback(CallbackRequest(name="approve"), d.wf, d.state, None)

        async def failing(kind: CheckpointType) -> None:
            if kind is CheckpointType.AFTER_TEARDOWN:
                raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            await resume(d.wf, d.state, failing)


@dataclass
class Parallel(Workflow):
    """A main thread and two workers that each wait for their own event."""

    done: list[str] = field(default_factory=list)
    ready: bool = False

    def definition(self) -> Section:
        def worker(tag: str) -> Section:
            return S(
                Wait(f"wait_{tag}", On(f"go_{tag}", REC)),
                Step(f"work_{tag}", lambda: self.done.append(tag)),
            )

        return S(
            Go("w1", worker("1")),
            Go("w2", worker("2")),
            Step("prepare", lambda: setattr(self, "ready", True)),
            Wait("main_wait", On("finish", REC)),
        )


class TestThreads:
    """Go threads, callbacks routed to them, and teardown when main ends."""

    @pytest.fixture(autouse=True)
    def _reset(self) -> None:
        REC.calls.clear()
        REC.fail_handle = REC.fail_setup = REC.fail_teardown = False

    async def test_callback_without_thread_id_finds_waiting_thread(self) -> None:
        """A callback with no thread id reaches the thread that waits for it (seed defect 4)."""
        d = Driver(Parallel())
        await d.resume()
        assert [t.id for t in d.state.threads] == [MAIN_THREAD, "w1", "w2"]
        await d.send("go_2")
        assert d.wf.done == ["2"]
        assert [t.id for t in d.state.threads] == [MAIN_THREAD, "w1"]

    async def test_thread_id_mismatch_not_found(self) -> None:
        """A callback naming the wrong thread is not found."""
        d = Driver(Parallel())
        await d.resume()
        with pytest.raises(CallbackNotFound):
            await d.send("go_2", thread_id="w1")

    async def test_main_end_tears_down_other_threads(self) -> None:
        """When main finishes, every pending wait of every thread is torn down (seed defect 5)."""
        d = Driver(Parallel())
        await d.resume()
        await d.send("finish")
        assert d.state.status is WorkflowStatus.FINISHED
        torn = {name for kind, name in REC.calls if kind.startswith("teardown")}
        assert torn == {"go_1", "go_2", "finish"}
        assert d.state.threads == []

    async def test_threads_finishing_together(self) -> None:
        """Several threads ending in one pass are all removed (seed defect 8)."""

        @dataclass
        class Burst(Workflow):
            n: int = 0

            def definition(self) -> Section:
                return S(
                    Go("a", S(Step("sa", lambda: setattr(self, "n", self.n + 1)))),
                    Go("b", S(Step("sb", lambda: setattr(self, "n", self.n + 1)))),
                    Go("c", S(Step("sc", lambda: setattr(self, "n", self.n + 1)))),
                    WaitFor("all", self.n == 3),
                )

        d = Driver(Burst())
        await d.resume()
        assert d.wf.n == 3
        assert d.state.status is WorkflowStatus.FINISHED

    async def test_go_in_loop_needs_ids(self) -> None:
        """Go started in a loop with distinct ids creates distinct threads."""

        @dataclass
        class Fan(Workflow):
            i: int = 0
            hits: list[int] = field(default_factory=list)

            def definition(self) -> Section:
                return S(
                    For(
                        "spawn",
                        self.i < 3,
                        Go("job", S(Wait("job_wait", On("job_go", REC))), id=str(self.i)),
                        Step("next", lambda: setattr(self, "i", self.i + 1)),
                    ),
                    Wait("hold", On("stop", REC)),
                )

        d = Driver(Fan())
        await d.resume()
        assert [t.id for t in d.state.threads] == [MAIN_THREAD, "job:0", "job:1", "job:2"]
        await d.send("job_go", thread_id="job:1")
        assert [t.id for t in d.state.threads] == [MAIN_THREAD, "job:0", "job:2"]


class Overlapping:
    """A Steps that forks every started step at once and completes them all in reverse."""

    def __init__(self) -> None:
        self.forks: list[tuple[str, Fork]] = []

    def start(self, thread_id: str, make_fork: Callable[[], Fork]) -> None:
        self.forks.append((thread_id, make_fork()))

    async def next(self) -> list[Done]:
        done: list[Done] = []
        for thread_id, f in reversed(self.forks):
            try:
                await call_action(f.step.action)
            except RuntimeError as e:
                done.append(Done(thread_id, failure=StepFailed(f.step.name, e)))
                continue
            f.finish()
            done.append(Done(thread_id, f))
        self.forks.clear()
        return done


@dataclass
class Overlap(Workflow):
    """Three threads that append, set their own key and all set `last`; one may fail."""

    items: list[str] = field(default_factory=list)
    own: dict[str, int] = field(default_factory=dict)
    last: str = ""
    fail: str = ""

    def act(self, tag: str) -> None:
        self.items.append(tag)
        self.own[tag] = len(self.items)
        self.last = tag
        if tag == self.fail:
            raise RuntimeError(f"{tag} broke")

    def definition(self) -> Section:
        return S(
            *[Go(f"g{t}", Step(f"s{t}", partial(self.act, t))) for t in "abc"],
            WaitFor("joined", len(self.own) == 3),
        )


class TestOverlappingSteps:
    """Steps of several threads in flight at once, through an injected Steps."""

    async def test_changes_merge_in_completion_order(self) -> None:
        """Appends land in completion order, own keys all land, and `last` takes the last
        completion's value with each overlapping change reported."""
        wf, state, kinds = Overlap(), State.new("o", "Overlap"), []
        conflicts: list[tuple[str, str, str]] = []

        async def save(kind: CheckpointType) -> None:
            kinds.append(kind)

        def on_conflict(path: str, step: str, thread_id: str) -> None:
            conflicts.append((path, step, thread_id))

        await resume(wf, state, save, steps=Overlapping(), on_conflict=on_conflict)
        assert state.status is WorkflowStatus.FINISHED
        assert wf.items == ["c", "b", "a"]
        assert wf.own == {"a": 1, "b": 1, "c": 1}  # each copy saw only its own append
        assert wf.last == "a"
        assert conflicts == [("last", "sb", "gb"), ("last", "sa", "ga")]
        # Saved once the three started, then after they completed.
        assert kinds.count(CheckpointType.STEPS_STARTED) == 1
        assert kinds.index(CheckpointType.STEPS_STARTED) < kinds.index(CheckpointType.AFTER_STEP)

    async def test_failed_step_changes_are_discarded(self) -> None:
        """A step that raises fails `resume`; its changes never reach the data."""
        wf, state = Overlap(fail="b"), State.new("o", "Overlap")

        async def save(kind: CheckpointType) -> None:
            return None

        with pytest.raises(StepFailed, match="b broke"):
            await resume(wf, state, save, steps=Overlapping())
        assert "b" not in wf.items and "b" not in wf.own


class TestWaitFor:
    """WaitFor blocks until its condition holds."""

    async def test_without_handler(self) -> None:
        """A WaitFor with no handler does not crash (seed defect 3)."""

        @dataclass
        class W(Workflow):
            flag: bool = False
            log: list[str] = field(default_factory=list)

            def definition(self) -> Section:
                return S(
                    Go("setter", S(Step("set", lambda: setattr(self, "flag", True)))),
                    WaitFor("until", self.flag),
                    Step("after", lambda: self.log.append("after")),
                )

        d = Driver(W())
        await d.resume()
        assert d.wf.log == ["after"]
        assert CheckpointType.AFTER_CONDITION in d.checkpoints

    async def test_conditions_checked_one_at_a_time(self) -> None:
        """A handler that falsifies another thread's condition keeps that thread waiting (defect 9)."""

        @dataclass
        class Token(Workflow):
            token: bool = False
            holders: list[str] = field(default_factory=list)

            def take(self, who: str) -> None:
                self.token = False
                self.holders.append(who)

            def definition(self) -> Section:
                return S(
                    Go("a", S(WaitFor("a_wait", self.token, lambda: self.take("a")))),
                    Go("b", S(WaitFor("b_wait", self.token, lambda: self.take("b")))),
                    Step("give", lambda: setattr(self, "token", True)),
                    Wait("hold", On("stop", Recorder())),
                )

        d = Driver(Token())
        await d.resume()
        assert d.wf.holders == ["a"]
        waiting = [t.id for t in d.state.threads if t.status is ThreadStatus.WAITING_CONDITION]
        assert waiting == ["b"]


class TestErrors:
    """Failures carry clear errors."""

    async def test_step_failure_names_step(self) -> None:
        """A raising step surfaces as StepFailed naming the step, thread still at it."""

        @dataclass
        class Boom(Workflow):
            def definition(self) -> Section:
                return S(Step("explode", lambda: 1 / 0))

        d = Driver(Boom())
        with pytest.raises(StepFailed, match="explode") as info:
            await d.resume()
        assert isinstance(info.value.cause, ZeroDivisionError)
        assert d.state.threads[0].status is ThreadStatus.EXECUTING
        assert d.state.threads[0].cur_step == "explode"

    async def test_missing_step_names_it(self) -> None:
        """A thread stopped at a statement no longer in the definition fails naming it (defect 7)."""
        d = Driver(Linear())
        d.state.threads[0].cur_step = "renamed_away"
        d.state.threads[0].status = ThreadStatus.EXECUTING
        with pytest.raises(StepNotFound, match="renamed_away"):
            await d.resume()
        d.state.threads[0].status = ThreadStatus.RESUMING
        with pytest.raises(StepNotFound, match="renamed_away"):
            await d.resume()

    @pytest.mark.parametrize(
        ("section", "message"),
        [
            (S(Step("a", print), Step("a", print)), "duplicate name 'a'"),
            (S(Break()), "outside a For"),
            (S(Wait("w")), "no cases"),
            (S(Wait("w", On("w", Recorder()))), "duplicate name 'w'"),
            (S(Step("", print)), "non-empty"),
        ],
    )
    def test_validate(self, section: Section, message: str) -> None:
        """Malformed definitions are rejected with a message saying why."""
        with pytest.raises(ValidationError, match=message):
            validate(section)


class TestDefinitionToDict:
    """The definition can be described as plain data."""

    def test_shape(self) -> None:
        """Every statement kind appears with its names, events and handler types."""
        d = definition_to_dict(Approval().definition())
        loop = d["children"][0]
        assert loop["type"] == "for" and loop["name"] == "rounds"
        wait = loop["children"][0]
        assert wait["type"] == "wait"
        assert [c["event"] for c in wait["cases"]] == ["approve", "reject"]
        assert wait["cases"][0]["handler"] == "recorder"
        assert wait["cases"][0]["children"] == [{"type": "step", "name": "approved"}]
        branches = definition_to_dict(Loops().definition())["children"][0]["children"][1]
        assert branches["type"] == "if"
        assert branches["branches"][0]["children"] == [{"type": "continue"}]


class Chaining:
    """A Steps that runs each lone step and, through `Start.then`, the thread's next ones."""

    def __init__(self) -> None:
        self.started: list[tuple[str, Start]] = []
        self.chained = 0

    def start(self, thread_id: str, make_fork: Callable[..., Fork]) -> None:
        assert isinstance(make_fork, Start)
        self.started.append((thread_id, make_fork))

    async def next(self) -> list[Done]:
        thread_id, start = self.started.pop(0)
        while True:
            f = start(alone=True)
            await call_action(f.step.action)
            nxt = start.then(f)
            if nxt is None or not nxt.begin():
                return [Done(thread_id, moved=True)]
            self.chained += 1
            start = nxt


@dataclass
class Counted(Workflow):
    """Counts to `n` in sync steps, then waits for `go`, then counts once more."""

    n: int = 5
    i: int = 0

    def inc(self) -> None:
        self.i += 1

    def definition(self) -> Section:
        return S(
            For("loop", self.i < self.n, Step("inc", self.inc)),
            Wait("w", On("go", Recorder())),
            Step("last", self.inc),
        )


class TestStartThen:
    async def test_a_runner_may_run_a_threads_steps_on_by_itself(self) -> None:
        """A runner that moves the thread on itself ends where the engine's loop would."""
        wf, state, kinds = Counted(), State.new("c", "Counted"), []

        async def save(kind: CheckpointType) -> None:
            kinds.append(kind)

        runner = Chaining()
        await resume(wf, state, save, steps=runner)
        assert wf.i == 5 and runner.chained == 4
        t = state.thread(MAIN_THREAD)
        assert t is not None and (t.status, t.cur_step) == (ThreadStatus.WAITING_EVENT, "w")
        assert kinds.count(CheckpointType.AFTER_STEP) == 1

    async def test_a_runaway_in_then_is_raised_by_the_engine(self) -> None:
        """Transitions made through `then` count: an endless loop of steps is still caught."""
        with pytest.raises(RunawayWorkflow):
            await resume(Counted(n=10**9), State.new("c", "Counted"), _no_save, steps=Chaining())


async def _no_save(kind: CheckpointType) -> None:
    return None
