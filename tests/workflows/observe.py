"""Workflows the metrics, hooks and dashboard tests run in a real daemon."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from daemon import NonRetryableError, On, S, Schedule, Section, Step, Wait, Workflow
from handlers import Signal, Timer

#: Appends its argv and the WORKFLOWD_ environment as one JSON line to $HOOK_OUT; a workflow
#: id starting with "slow" sleeps first (a hook that hangs). No braces: the argv is a template.
HOOK_SCRIPT = """
import json, os, sys, time
wid = os.environ["WORKFLOWD_WORKFLOW_ID"]
if wid.startswith("slow"):
    with open(os.environ["HOOK_OUT"] + ".pids", "a") as f:
        f.write(str(os.getpid()) + "\\n")
    time.sleep(60)
env = dict((k, v) for k, v in os.environ.items() if k.startswith("WORKFLOWD_"))
with open(os.environ["HOOK_OUT"], "a") as f:
    f.write(json.dumps(dict(argv=sys.argv[1:], env=env)) + "\\n")
"""


def hook_argv(*args: str) -> list[str]:
    """Return an argv template that runs HOOK_SCRIPT with `args`."""
    return [sys.executable, "-c", HOOK_SCRIPT, *args]


@dataclass
class Counted(Workflow):
    """Three steps, then waits for `go`."""

    n: int = 0

    def bump(self) -> None:
        self.n += 1

    def definition(self) -> Section:
        return S(
            Step("a", self.bump),
            Step("b", self.bump),
            Step("c", self.bump),
            Wait("gate", On("go", Signal())),
        )


@dataclass
class Doomed(Workflow):
    """Fails at once in its one step."""

    reason: str = "card declined"

    def boom(self) -> None:
        raise NonRetryableError(self.reason)

    def definition(self) -> Section:
        return S(Step("boom", self.boom))


@dataclass
class SelfHooked(Workflow):
    """Fails at once; its own `on_failure` replaces the `[hooks]` one."""

    on_failure = hook_argv("own", "{workflow}", "{event}")

    def boom(self) -> None:
        raise NonRetryableError("own failure")

    def definition(self) -> Section:
        return S(Step("boom", self.boom))


@dataclass
class Gatekeeper(Workflow):
    """Waits for `go` (or a far timer), then either finishes or, with `fail`, fails."""

    fail: bool = False
    note: str = ""

    def go(self, note: str) -> str:
        self.note = note
        return "ok"

    def after(self) -> None:
        if self.fail:
            raise NonRetryableError("told to fail")

    def definition(self) -> Section:
        return S(
            Step("prepare", lambda: None),
            Wait("gate", On("go", Signal(self.go)), On("too_late", Timer(after=3600))),
            Step("after", self.after),
        )


@dataclass
class Ticker(Workflow):
    """A short timer, then done."""

    def definition(self) -> Section:
        return S(Wait("ticking", On("tick", Timer(after=0.05))))


@dataclass
class Blip(Workflow):
    """One step; started by the `blip` schedule."""

    def definition(self) -> Section:
        return S(Step("blip", lambda: None))


blip = Schedule("blip", "Blip", every=1.0)
