"""Workflows for tests/e2e/test_compose.py: child workflows, command steps and deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from daemon import Go, NonRetryableError, On, Retry, Run, S, Section, Step, Wait, WaitFor, Workflow
from daemon.core.handler import CallbackRequest
from handlers import Child, Signal, Timer
from handlers.child import Policy


@dataclass
class Adder(Workflow):
    """A child that adds two numbers; its `result()` is what its parent gets."""

    a: int = 0
    b: int = 0
    total: int = 0

    def add(self) -> None:
        self.total = self.a + self.b

    def result(self) -> dict[str, int]:
        """Return what a parent's Child case receives as `result`."""
        return {"sum": self.total}

    def definition(self) -> Section:
        return S(Step("add", self.add))


@dataclass
class Breaker(Workflow):
    """A child that fails at once; it has no `result()`, so its parent gets its data."""

    note: str = "about to fail"

    def boom(self) -> None:
        raise NonRetryableError("the child broke")

    def definition(self) -> Section:
        return S(Step("boom", self.boom))


@dataclass
class Nest(Workflow):
    """Starts a Nest one level down until level 0, which waits for the signal `go`."""

    level: int = 0
    abandon: bool = False

    def definition(self) -> Section:
        if self.level == 0:
            return S(Wait("w", On("go", Signal())))
        policy: Policy = "abandon" if self.abandon else "cancel"
        kid = Child("Nest", input={"level": self.level - 1}, on_parent_end=policy)
        return S(Wait("w", On("kid", kid)))


@dataclass
class Parent(Workflow):
    """Waits for one child (`kind`, `kid_input`), or a timer if `race_s` is set."""

    kind: str = "Adder"
    kid_input: dict[str, Any] = field(default_factory=dict)
    race_s: float = 0.0
    outcome: dict[str, Any] = field(default_factory=dict)
    ended_by: str = ""

    def took(self, outcome: dict[str, Any]) -> None:
        self.outcome, self.ended_by = outcome, "child"

    def timed_out(self) -> None:
        self.ended_by = "timer"

    def definition(self) -> Section:
        kid = On("kid", Child(self.kind, input=self.kid_input, fn=self.took))
        if self.race_s:
            return S(
                Wait("w", kid, On("late", Timer(after=self.race_s), Step("t", self.timed_out)))
            )
        return S(Wait("w", kid))


class Gate:
    """A test handler whose setup blocks until the file `path` exists (it never fires)."""

    type = "gate"

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    async def setup(self, req: CallbackRequest) -> str:
        """Return once the file exists; until then the workflow's wait is not saved."""
        while not self.path.exists():  # noqa: ASYNC110 - a test double; the file has no event
            await anyio.sleep(0.02)
        return ""

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Return the input."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Release nothing."""


@dataclass
class GatedParent(Workflow):
    """Starts an Adder child, then blocks its own checkpoint in a Gate's setup."""

    gate: str = ""
    outcome: dict[str, Any] = field(default_factory=dict)

    def took(self, outcome: dict[str, Any]) -> None:
        self.outcome = outcome

    def definition(self) -> Section:
        kid = On("kid", Child("Adder", input={"a": 2, "b": 3}, fn=self.took))
        return S(Wait("w", kid, On("gate", Gate(self.gate))))


@dataclass
class Command(Workflow):
    """Runs `argv` once (no retry) as a Run step, storing its result in `out`."""

    argv: list[str] = field(default_factory=list)
    timeout: float = 0.0
    max_bytes: int = 65536
    out: dict[str, Any] = field(default_factory=dict)

    def definition(self) -> Section:
        return S(
            Run(
                "cmd",
                self.argv,
                timeout=self.timeout or None,
                output_max_bytes=self.max_bytes,
                retry=Retry(max_attempts=1),
                into="out",
            )
        )


@dataclass
class Deadline(Workflow):
    """Has a 1 s deadline; meanwhile waits for a Nest child, or runs a long command."""

    timeout_s = 1.0

    #: Where the command writes its process group id; empty: wait for a child instead.
    pidfile: str = ""

    def definition(self) -> Section:
        if not self.pidfile:
            return S(Wait("w", On("kid", Child("Nest", input={"level": 0}))))
        # The command records its process group, then outlives the deadline.
        return S(Run("long", ["sh", "-c", f"echo $$ > {self.pidfile}; exec sleep 60"]))


@dataclass
class Patient(Workflow):
    """Waits for the signal `go`; has no deadline of its own (start --timeout sets one)."""

    def definition(self) -> Section:
        return S(Wait("w", On("go", Signal())))


@dataclass
class Release(Workflow):
    """The README's fan-out recipe: one thread and one Adder child per item, then a WaitFor."""

    nums: list[int] = field(default_factory=list)
    built: dict[str, dict[str, Any]] = field(default_factory=dict)

    def took(self, outcome: dict[str, Any]) -> None:
        self.built[outcome["workflow_id"]] = outcome

    def definition(self) -> Section:
        builds = [
            Go(
                f"build_{i}",
                Wait(f"wait_{i}", On(f"built_{i}", Child("Adder", input={"a": n}, fn=self.took))),
            )
            for i, n in enumerate(self.nums)
        ]
        return S(*builds, WaitFor("all_built", len(self.built) == len(self.nums)))
