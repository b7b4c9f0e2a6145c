"""Workflows the workflowctl end-to-end tests (tests/e2e/test_ctl_*.py) run in a real daemon."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog

from daemon import Go, NonRetryableError, On, Retry, S, Section, Step, Wait, Workflow
from handlers import Signal, Timer

log = structlog.get_logger()


@dataclass
class Verdict:
    """The input of Vetting's `decide` event."""

    approve: bool
    by: str = ""


@dataclass
class Vetting(Workflow):
    """Waits for `decide` (or an hour), while a second thread waits for `note`."""

    request: str = ""
    approved: bool = False
    notes: list[str] = field(default_factory=list)

    def decide(self, v: Verdict) -> str:
        self.approved = v.approve
        return f"{'approved' if v.approve else 'rejected'} by {v.by}"

    def note(self, text: Any) -> None:
        log.info("note_taken", text=text)  # client input in a log field, as real code does
        self.notes.append(str(text))

    def result(self) -> dict[str, Any]:
        return {"approved": self.approved, "notes": len(self.notes)}

    def definition(self) -> Section:
        return S(
            Go("notes", S(Wait("await_note", On("note", Signal(self.note)))), id="notes"),
            Wait(
                "await_decision",
                On("decide", Signal(self.decide)),
                On("expired", Timer(after=3600)),
            ),
        )


@dataclass
class Latch(Workflow):
    """Waits for `open`, then ends; `fail` fails it, so its end status is the sender's choice."""

    failing: bool = False

    def fail(self) -> None:
        self.failing = True

    def check(self) -> None:
        if self.failing:
            raise NonRetryableError("asked to fail")

    def definition(self) -> Section:
        return S(
            Wait("await_open", On("open", Signal()), On("fail", Signal(self.fail))),
            Step("check", self.check),
        )


@dataclass
class Wobbly(Workflow):
    """A step that fails every time, retried slowly: `show` has a retry state to describe."""

    tries: int = 0

    def wobble(self) -> None:
        self.tries += 1
        raise RuntimeError("still wobbly")

    def definition(self) -> Section:
        return S(Step("wobble", self.wobble, retry=Retry(initial_s=30, max_s=30, max_attempts=6)))
