"""Workflows the repair tests (goto, edit, undo, retry, hold) run inside a real daemon."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from daemon import For, Go, If, On, Retry, S, Section, Step, Wait, WaitFor, Workflow
from handlers import Signal, Timer


@dataclass
class Payment(Workflow):
    """Prepares, charges (failing at once unless `card` is valid) and sends a receipt."""

    card: str = "expired"
    charged: bool = False
    receipt: bool = False
    log: list[str] = field(default_factory=list)

    def prepare(self) -> None:
        self.log.append("prepare")

    def charge(self) -> None:
        self.log.append("charge")
        if self.card != "valid":
            raise ValueError(f"card {self.card!r} declined")
        self.charged = True

    def send_receipt(self) -> None:
        self.log.append("receipt")
        self.receipt = True

    def definition(self) -> Section:
        return S(
            Step("prepare", self.prepare),
            Step("charge", self.charge, retry=Retry(max_attempts=1)),
            Step("send_receipt", self.send_receipt),
        )


@dataclass
class Bollard(Workflow):
    """Fails at its check unless `open`, then waits for the signal `go` (for deadlines)."""

    open: bool = False

    def check(self) -> None:
        if not self.open:
            raise ValueError("gate closed")

    def definition(self) -> Section:
        return S(
            Step("check", self.check, retry=Retry(max_attempts=1)),
            Wait("w", On("go", Signal())),
        )


@dataclass
class Review(Workflow):
    """Waits for a verdict (a side thread waits for a nudge), then for `ready`, then finishes."""

    verdict: str = ""
    ready: bool = False
    rounds: int = 0
    log: list[str] = field(default_factory=list)

    def decide(self, verdict: str) -> str:
        self.verdict = verdict
        return f"got {verdict}"

    def note(self, what: str) -> None:
        self.log.append(what)

    def definition(self) -> Section:
        return S(
            Go("side", S(Wait("nudge_wait", On("nudge", Signal(), Step("nudged", self.nudged))))),
            For(
                "rounds_loop",
                self.rounds < 1,
                Wait(
                    "ask",
                    On(
                        "decide", Signal(self.decide), Step("decided", lambda: self.note("decided"))
                    ),
                    On("late", Timer(after=600), Step("timed_out", lambda: self.note("late"))),
                ),
                Step("count", self.count),
            ),
            If(
                self.verdict == "no", "rejected", Step("reject", lambda: self.note("rejected"))
            ).else_("accepted", Step("accept", lambda: self.note("accepted"))),
            Wait("second", On("again", Signal()), On("second_late", Timer(after=600))),
            WaitFor("ready_wait", self.ready),
            Step("finish", lambda: self.note("finished")),
        )

    def nudged(self) -> None:
        self.log.append("nudged")

    def count(self) -> None:
        self.rounds += 1


@dataclass
class Slow(Workflow):
    """Runs one long async step (cancelled when the workflow is)."""

    async def sleep(self) -> None:
        await anyio.sleep(60)

    def definition(self) -> Section:
        return S(Step("sleep", self.sleep))


@dataclass
class Ticks(Workflow):
    """Waits for a short timer, then finishes."""

    after: float = 0.3
    fired: bool = False

    def definition(self) -> Section:
        return S(
            Wait("nap", On("tick", Timer(after=self.after))),
            Step("done", self.done),
        )

    def done(self) -> None:
        self.fired = True


@dataclass
class Needs(Workflow):
    """Has a field without a default."""

    who: str

    def definition(self) -> Section:
        return S(Step("greet", lambda: None))


@dataclass
class Dupes(Workflow):
    """Uses one name twice: a definition error `lint` reports."""

    def definition(self) -> Section:
        return S(Step("same", lambda: None), Step("same", lambda: None))
