"""Example workflows the default config runs; each shows a part of the DSL."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import structlog

from daemon.core.statements import For, Go, If, On, S, Section, Step, Wait
from daemon.core.workflow import Workflow
from handlers import FileWatch, Signal, Timer

log = structlog.get_logger()


@dataclass
class Decision:
    """What an approver sends: `{"approve": true, "by": "ann", "note": "..."}`."""

    approve: bool
    by: str
    note: str = ""


@dataclass
class Approval(Workflow):
    """Waits for a decision or a timeout, whichever comes first."""

    request: str = ""
    timeout_s: float = 3600.0
    outcome: str = ""
    decided_by: str = ""

    def decide(self, d: Decision) -> str:
        self.outcome = "approved" if d.approve else "rejected"
        self.decided_by = d.by
        return f"{self.request or 'request'} {self.outcome} by {d.by}"

    def definition(self) -> Section:
        return S(
            Wait(
                "await_decision",
                On("decide", Signal(self.decide)),
                On("timeout", Timer(after=self.timeout_s), Step("expire", self.expire)),
            ),
            If(self.outcome == "approved", "if_approved", Step("carry_out", self.carry_out)),
        )

    def expire(self) -> None:
        self.outcome = "expired"

    def carry_out(self) -> None:
        log.info("carrying_out", request=self.request)


@dataclass
class Countdown(Workflow):
    """Ticks `n` times, `interval_s` apart, unless a parallel thread hears "abort"."""

    n: int = 3
    interval_s: float = 1.0
    ticks: list[int] = field(default_factory=list)
    aborted: bool = False

    def definition(self) -> Section:
        return S(
            Go("watch_abort", S(Wait("abort_wait", On("abort", Signal(self.abort))))),
            For(
                "tick_loop",
                len(self.ticks) < self.n and not self.aborted,
                Wait("tick_wait", On("tick", Timer(after=self.interval_s))),
                Step("count_tick", lambda: self.ticks.append(len(self.ticks) + 1)),
            ),
        )

    def abort(self, _: object) -> str:
        self.aborted = True
        return "aborting"


@dataclass
class AwaitFile(Workflow):
    """Waits until a file exists (or a day passes), then records its size."""

    path: str = "state/incoming/ready"
    size: int = -1
    timed_out: bool = False

    def definition(self) -> Section:
        return S(
            Wait(
                "file_or_timeout",
                On("file_ready", FileWatch(self.path, on="exists"), Step("measure", self.measure)),
                On("give_up", Timer(after=86400), Step("time_out", self.time_out)),
            )
        )

    def measure(self) -> None:
        self.size = os.path.getsize(self.path)

    def time_out(self) -> None:
        self.timed_out = True
