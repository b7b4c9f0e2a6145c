"""Workflows the end-to-end tests run inside a real daemon; steps log to an O_APPEND file."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from daemon import For, Go, On, S, Section, Step, Wait, Workflow
from handlers import Signal, Timer


def append_step_log(line: str) -> None:
    """Append one line to $E2E_STEP_LOG (O_APPEND: whole lines, safe across crashes)."""
    path = os.environ.get("E2E_STEP_LOG")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def record(workflow_id: str, step: str, attempt: int) -> None:
    """Record one step run as `workflow_id step attempt`."""
    append_step_log(f"{workflow_id} {step} {attempt}")


@dataclass
class Steps(Workflow):
    """Runs `n` slow steps in a loop, recording each run."""

    id: str = ""
    n: int = 20
    i: int = 0
    delay_s: float = 0.01

    def step(self) -> None:
        record(self.id, f"s{self.i}", 0)
        time.sleep(self.delay_s)
        self.i += 1

    def definition(self) -> Section:
        return S(For("loop", self.i < self.n, Step("work", self.step)))


@dataclass
class Turnstile(Workflow):
    """Counts signals in a loop until `need` arrived, with a parallel timer thread."""

    id: str = ""
    need: int = 3
    got: list[int] = field(default_factory=list)
    ticked: bool = False

    def add(self, value: int) -> int:
        self.got.append(value)
        return len(self.got)

    def definition(self) -> Section:
        return S(
            Go(
                "ticker",
                S(Wait("tick_wait", On("tick", Timer(after=0.2))), Step("tock", self.tock)),
            ),
            For(
                "collect",
                len(self.got) < self.need,
                Wait("gate", On("add", Signal(self.add))),
                Step("count", lambda: record(self.id, f"count{len(self.got)}", 0)),
            ),
        )

    def tock(self) -> None:
        self.ticked = True
