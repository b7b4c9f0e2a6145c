"""Workflows the resume tests run inside a real workflowd: a step between two waits."""

from __future__ import annotations

from dataclasses import dataclass

from daemon import For, On, S, Section, Step, Wait, Workflow
from handlers import Signal, Timer


@dataclass
class StepBetweenSignals(Workflow):
    """Takes a "bump" signal, then runs a sync step, then waits for the next one, forever."""

    bumps: int = 0
    steps: int = 0

    def bump(self) -> int:
        self.bumps += 1
        return self.bumps

    def count(self) -> None:
        self.steps += 1

    def definition(self) -> Section:
        return S(
            For(
                "loop",
                True,
                Wait("wait", On("bump", Signal(self.bump))),
                Step("count", self.count),
            )
        )


@dataclass
class StepThenTimer(Workflow):
    """Takes a "go" signal, runs a sync step, then waits for a timer `after_s` later."""

    steps: int = 0
    rang: bool = False
    after_s: float = 0.2

    def count(self) -> None:
        self.steps += 1

    def ring(self) -> None:
        self.rang = True

    def definition(self) -> Section:
        return S(
            Wait("gate", On("go", Signal())),
            Step("count", self.count),
            Wait("sleep", On("ring", Timer(after=self.after_s))),
            Step("note_rang", self.ring),
        )


@dataclass
class TimerThenStep(Workflow):
    """Waits for a short timer, then runs a sync step, `n` times over; then ends."""

    n: int = 10
    steps: int = 0

    def count(self) -> None:
        self.steps += 1

    def definition(self) -> Section:
        return S(
            For(
                "loop",
                self.steps < self.n,
                Wait("sleep", On("ring", Timer(after=0.05))),
                Step("count", self.count),
            )
        )
