"""The engine's shortcuts give what its general paths give: the lone-thread loop, the walks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from daemon import (
    Break,
    CallbackRequest,
    CheckpointType,
    Continue,
    For,
    Go,
    If,
    On,
    Return,
    RunawayWorkflow,
    S,
    Section,
    State,
    Step,
    StepFailed,
    StepNotFound,
    ValidationError,
    Wait,
    WaitFor,
    Workflow,
    WorkflowStatus,
    handle_callback,
    resume,
)
from daemon.core.definition import Definition
from daemon.core.engine import Done, Steps, _Inline, _run_step
from daemon.core.merge import Fork
from tests.helpers.support import Recorder


class General(_Inline):
    """The engine's own runner, handed in as `steps`: the general loop then runs every step."""

    def __init__(self) -> None:
        super().__init__(_run_step)


class MyStep(Step):
    """A statement subclass: found by the walks through its base class."""


class MyFor(For):
    """A For subclass."""


@dataclass
class Mixed(Workflow):
    """Loops, a branch whose shape follows the data, a Break, a Continue, a Return."""

    i: int = 0
    log: list[str] = field(default_factory=list)
    fail_at: int = -1

    def tick(self) -> None:
        if self.i == self.fail_at:
            self.log.append("boom")
            raise RuntimeError("boom")
        self.i += 1
        self.log.append(f"tick{self.i}")

    def note(self, what: str) -> Callable[[], None]:
        return lambda: self.log.append(what)

    def definition(self) -> Section:
        # The tree's shape depends on the data: odd counts have one more statement.
        odd = (Step("odd", self.note(f"odd{self.i}")),) if self.i % 2 else ()
        return S(
            MyFor(
                "loop",
                self.i < 6,
                MyStep("tick", self.tick),
                If(self.i == 3, "three", Continue()).elif_(self.i == 5, "five", Break()),
                *odd,
            ),
            Step("after", self.note("after")),
            If(self.i == 5, "early", Return()),
            Step("last", self.note("last")),
        )


@dataclass
class Forever(Workflow):
    """A loop without a step: a runaway."""

    def definition(self) -> Section:
        return S(For("spin", True, If(True, "yes")))


@dataclass
class Spawning(Workflow):
    """Steps, then a Go: the lone thread hands over to the general loop."""

    log: list[str] = field(default_factory=list)

    def add(self, what: str) -> Callable[[], None]:
        return lambda: self.log.append(what)

    def definition(self) -> Section:
        return S(
            Step("a", self.add("a")),
            Go("side", S(Step("s1", self.add("s1")), Step("s2", self.add("s2")))),
            Step("b", self.add("b")),
            WaitFor("side_done", "s2" in self.log),
            Step("c", self.add("c")),
        )


@dataclass
class Timed(Workflow):
    """A step with a timeout runs on a copy of the data, merged back."""

    n: int = 0

    def bump(self) -> None:
        self.n += 1

    def definition(self) -> Section:
        return S(Step("bump", self.bump, timeout=5.0), Step("again", self.bump))


@dataclass
class Waiting(Workflow):
    """A step, a wait, a step."""

    recorder: Any = None
    n: int = 0

    def bump(self) -> None:
        self.n += 1

    def definition(self) -> Section:
        return S(
            Step("one", self.bump),
            Wait("w", On("go", self.recorder)),
            Step("two", self.bump),
        )


async def _run(wf: Workflow, steps: Steps | None) -> tuple[list[str], str, str, str]:
    kinds: list[str] = []

    async def save(kind: CheckpointType) -> None:
        kinds.append(str(kind))

    state = State.new("w", type(wf).name)
    error = ""
    try:
        await resume(wf, state, save, steps=steps)
    except Exception as e:  # noqa: BLE001 - compared between the two paths
        error = f"{type(e).__name__}: {e}"
    return kinds, state.to_json(), wf.to_json(), error


@pytest.mark.parametrize(
    "make",
    [
        lambda: Mixed(),
        lambda: Mixed(fail_at=3),
        lambda: Forever(),
        lambda: Spawning(),
        lambda: Timed(),
    ],
    ids=["mixed", "failing", "runaway", "spawning", "timed"],
)
async def test_the_lone_thread_loop_matches_the_general_loop(make: Callable[[], Workflow]) -> None:
    """Checkpoints, state, data and errors are the same with and without the flat loop."""
    flat = await _run(make(), None)
    general = await _run(make(), General())
    assert flat == general
    assert flat[0] or flat[3], "no checkpoint and no error: nothing was compared"


async def test_the_mixed_workflow_runs_as_its_definition_says() -> None:
    """The data-shaped branch, Continue, Break, Return and subclasses all take effect."""
    kinds, _, data, error = await _run(Mixed(), None)
    assert error == ""
    wf = Mixed.from_json(data)
    # odd3 is skipped by the Continue, the rest of the loop by the Break, "last" by the Return.
    assert wf.log == ["tick1", "odd1", "tick2", "tick3", "tick4", "tick5", "after"]
    assert kinds.count(str(CheckpointType.AFTER_STEP)) >= 1


async def test_a_failing_step_is_undone_and_reported_the_same_way() -> None:
    """The lone loop undoes a failed step's changes in place and raises StepFailed."""
    wf = Mixed(fail_at=3)
    state = State.new("w", "Mixed")

    async def save(kind: CheckpointType) -> None:
        return None

    with pytest.raises(StepFailed, match="boom"):
        await resume(wf, state, save)
    assert wf.i == 3
    assert "boom" not in wf.log  # undone with the rest of the failed step's changes


async def test_a_runaway_is_caught_by_the_lone_loop() -> None:
    """A loop that never blocks ends in RunawayWorkflow, as on the general path."""

    async def save(kind: CheckpointType) -> None:
        return None

    with pytest.raises(RunawayWorkflow):
        await resume(Forever(), State.new("w", "Forever"), save)


async def test_a_wait_in_the_lone_loop_blocks_and_resumes() -> None:
    """The lone loop stops at a Wait; the callback and the next resume go on after it."""
    recorder = Recorder()
    flat: list[tuple[list[str], str]] = []
    for steps in (None, General()):
        wf = Waiting(recorder=recorder)
        state = State.new("w", "Waiting")
        kinds: list[str] = []

        async def save(kind: CheckpointType) -> None:
            kinds.append(str(kind))  # noqa: B023 - used before the next iteration

        await resume(wf, state, save, steps=steps)
        assert str(state.status) == WorkflowStatus.WAITING and wf.n == 1
        await handle_callback(CallbackRequest(name="go"), wf, state, None)
        await resume(wf, state, save, steps=steps)
        assert state.status is WorkflowStatus.FINISHED and wf.n == 2
        flat.append((kinds, state.to_json()))
    assert flat[0] == flat[1]


@dataclass
class Renamed(Workflow):
    """Its step's name follows the data, as a statement renamed by a code change would."""

    version: int = 1

    def bump(self) -> None:
        self.version += 1

    def definition(self) -> Section:
        return S(Step(f"step_v{self.version}", self.bump), Step("end", lambda: None))


async def test_a_renamed_statement_fails_clearly_on_both_paths() -> None:
    """A thread stopped at a step no longer in the definition gets StepNotFound, not a crash."""
    for steps in (None, General()):
        wf = Renamed()
        state = State.new("w", "Renamed")
        thread = state.threads[0]
        thread.cur_step = "step_v0"  # stored by an older version of the code

        async def save(kind: CheckpointType) -> None:
            return None

        with pytest.raises(StepNotFound, match="step_v0"):
            await resume(wf, state, save, steps=steps)


class TestDefinitionIndex:
    """The one-frame-per-block index finds and rejects what the per-statement one did."""

    def test_subclasses_and_nesting_are_indexed(self) -> None:
        """Every named thing is found, subclasses of statements included."""
        rec = Recorder()
        root = S(
            MyFor("f", True, MyStep("s", lambda: None), S(Step("inner", lambda: None))),
            Wait("w", On("e", rec, Step("in_case", lambda: None))),
            If(True, "yes", Step("y", lambda: None)).else_("no"),
            Go("g", Step("g1", lambda: None)),
            WaitFor("wf", True),
            Return(),
        )
        names = set(Definition(root).named)
        assert names == {"f", "s", "inner", "w", "e", "in_case", "yes", "y", "no", "g", "g1", "wf"}
        assert isinstance(Definition(root).get("s", Step), MyStep)

    @pytest.mark.parametrize(
        ("root", "message"),
        [
            (S(Step("a", print), Step("a", print)), "duplicate name 'a' (step)"),
            (S(Step("", print)), "step needs a non-empty string name"),
            (S(WaitFor("", True)), "wait_for needs a non-empty string name"),
            (S(Break()), "Break() outside a For"),
            (S(For("f", True, Go("g", Continue()))), "Continue() outside a For"),
            (S(Wait("w")), "wait 'w' has no cases"),
            # The event is claimed before its case's body is walked, as before.
            (S(Wait("w", On("b", Recorder(), Step("b", print)))), "duplicate name 'b' (step)"),
            (S(Wait("w", On("x", Recorder()), On("x", Recorder()))), "duplicate name 'x' (event)"),
        ],
    )
    def test_bad_definitions_get_the_same_errors(self, root: Section, message: str) -> None:
        """Each defect is reported with the message the old index gave."""
        with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Definition(root)

    def test_a_case_that_is_not_an_on_is_rejected(self) -> None:
        """A Wait's cases must be On(...)."""
        with pytest.raises(ValidationError, match="cases must be On"):
            Definition(S(Wait("w", Step("s", print))))  # type: ignore[arg-type]


@dataclass
class Item:
    """A nested dataclass of workflow data."""

    x: int = 3
    tags: list[str] = field(default_factory=list)


@dataclass
class Holder(Workflow):
    """Dataclasses in a list, a dict and an optional field."""

    items: list[Item] = field(default_factory=list)
    by_key: dict[str, Item] = field(default_factory=dict)
    one: Item | None = None


class TestDataCaches:
    """What workflow.py keeps per class follows a class that is replaced (a reload)."""

    def test_a_reloaded_class_gets_its_own_fields_and_defaults(self) -> None:
        """Two classes of one name: each loads with its own fields and stores its defaults."""

        @dataclass
        class Reloaded(Workflow):
            name = "Reloaded"
            a: int = 1

        old = Reloaded.from_json("{}")
        assert vars(old) == {"a": 1}

        @dataclass
        class Reloaded(Workflow):  # type: ignore[no-redef]
            name = "Reloaded"
            a: int = 2
            b: list[int] = field(default_factory=lambda: [7])

        new = Reloaded.from_json("{}")
        assert vars(new) == {"a": 2, "b": [7]}
        assert new.to_json() == '{"a":2,"b":[7]}'

    def test_nested_dataclasses_get_their_defaults_stored(self) -> None:
        """Defaults are stored inside lists and dicts of dataclasses too, not only at the top."""

        wf = Holder.from_json('{"items": [{}], "by_key": {"k": {"tags": ["t"]}}, "one": {}}')
        assert vars(wf.items[0]) == {"x": 3, "tags": []}
        assert vars(wf.by_key["k"]) == {"x": 3, "tags": ["t"]}
        assert wf.one is not None and vars(wf.one) == {"x": 3, "tags": []}

    def test_restore_uses_the_class_of_the_workflow(self) -> None:
        """`restore` puts back a snapshot through the workflow's own class."""

        @dataclass
        class Snap(Workflow):
            n: int = 0

        wf = Snap()
        snap = wf.snapshot()
        wf.n = 5
        wf.restore(snap)
        assert wf.n == 0


def test_general_runner_is_a_steps() -> None:
    """The reference runner above is a real Steps (so the general loop is what it runs)."""
    runner: Steps = General()
    runner.start("t", lambda **kw: Fork(None, Step("s", print), {}))
    assert asyncio.iscoroutinefunction(runner.next)
    assert Done("t").fork is None


class MyBreak(Break):
    """A Break subclass."""


class MyReturn(Return):
    """A Return subclass."""


@dataclass
class SubclassedJumps(Workflow):
    """A loop left by a Break subclass, then a thread ended by a Return subclass."""

    i: int = 0
    log: list[str] = field(default_factory=list)

    def tick(self) -> None:
        self.i += 1

    def definition(self) -> Section:
        return S(
            For("loop", True, Step("tick", self.tick), If(self.i >= 3, "enough", MyBreak())),
            Step("after", lambda: self.log.append("after")),
            MyReturn(),
            Step("never", lambda: self.log.append("never")),
        )


async def test_subclasses_of_break_and_return_act_like_them() -> None:
    """A subclass of a jump statement jumps (the old cursor raised KeyError on it)."""

    async def save(kind: CheckpointType) -> None:
        return None

    wf = SubclassedJumps()
    state = State.new("w", "SubclassedJumps")
    await resume(wf, state, save)
    assert state.status is WorkflowStatus.FINISHED
    assert (wf.i, wf.log) == (3, ["after"])


@dataclass
class LoneBodies(Workflow):
    """Loops whose body is one statement, nested, side by side and before other statements."""

    i: int = 0
    j: int = 0
    k: int = 0
    log: list[str] = field(default_factory=list)

    def inner(self) -> None:
        self.j += 1
        self.log.append(f"inner{self.i}.{self.j}")

    def reset(self) -> None:
        self.i, self.j = self.i + 1, 0
        self.log.append(f"reset{self.i}")

    def waited(self) -> None:
        self.k += 1
        self.log.append(f"waited{self.k}")

    def definition(self) -> Section:
        return S(
            For(
                "outer",
                self.i < 2,
                For("inner", self.j < 2, Step("inner_step", self.inner)),
                Step("reset", self.reset),
            ),
            For("conds", self.k < 2, WaitFor("cond", True, self.waited)),
            For("never", False, Step("skipped", lambda: self.log.append("skipped"))),
            For("spin", self.k < 3, Step("spun", self.waited)),
            For("pair", self.k < 4, Step("first", self.waited), Step("second", self.waited)),
            Step("after", lambda: self.log.append("after")),
        )


@pytest.mark.parametrize("steps", [None, "general"])
async def test_a_loop_of_one_statement_is_searched_as_any_other(steps: str | None) -> None:
    """A thread stopped at a loop body's only statement goes on as its definition says."""
    wf = LoneBodies()
    kinds, _, data, error = await _run(wf, General() if steps else None)
    assert error == ""
    assert LoneBodies.from_json(data).log == [
        "inner0.1", "inner0.2", "reset1",
        "inner1.1", "inner1.2", "reset2",
        "waited1", "waited2",
        "waited3",
        "waited4", "waited5",
        "after",
    ]  # fmt: skip
    assert kinds.count(str(CheckpointType.AFTER_CONDITION)) == 2


@dataclass
class OneStepForever(Workflow):
    """A loop of one step that never ends: a runaway once the transitions run out."""

    n: int = 0

    def bump(self) -> None:
        self.n += 1

    def definition(self) -> Section:
        return S(For("loop", True, Step("bump", self.bump)))


async def test_a_loop_of_one_step_still_counts_its_transitions() -> None:
    """Each pass of a one-step loop counts, so an endless one is caught as a runaway."""

    async def save(kind: CheckpointType) -> None:
        return None

    wf = OneStepForever()
    with pytest.raises(RunawayWorkflow):
        await resume(wf, State.new("w", "OneStepForever"), save)
    assert 0 < wf.n < 10_000
