"""Workflows the pipeline tests run inside a real daemon: many sync steps with a wait now and then.

`PipeTicker` runs `n` synchronous steps; each appends its index to the file `log` before it counts
it, so a test can tell which steps ran more than once. Every `every` steps it waits for a
`tick` signal, whose input it keeps in `ticks`: a test can check that every acknowledged send
was applied, once and in order, across a kill or a failing write.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from daemon import For, If, On, S, Section, Step, Wait, Workflow
from handlers import Signal


@dataclass
class PipeTicker(Workflow):
    """Runs `n` sync steps, logging each one's index to `log`; waits for a tick every `every`."""

    n: int = 1000
    every: int = 100
    log: str = ""
    i: int = 0
    ticks: list[int] = field(default_factory=list)

    def work(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"{self.i}\n")
        self.i += 1

    def tick(self, value: int) -> int:
        self.ticks.append(int(value))
        return len(self.ticks)

    def definition(self) -> Section:
        due = self.i % self.every == 0 and 0 < self.i < self.n
        return S(
            For(
                "steps",
                self.i < self.n,
                Step("work", self.work),
                If(due, "due", Wait("ticked", On("tick", Signal(self.tick)))),
            )
        )


@dataclass
class GatedRun(Workflow):
    """Runs `n` sync steps, logging each index to `log`; step `gate_at` waits for `gate` (a file)
    to exist, and step `fail_at` fails once (it leaves the file `failed` behind)."""

    n: int = 100
    log: str = ""
    gate: str = ""
    gate_at: int = -1
    fail_at: int = -1
    i: int = 0

    def work(self) -> None:
        if self.i == self.fail_at and not os.path.exists(f"{self.log}.failed"):
            with open(f"{self.log}.failed", "w"):
                pass
            self.i = -1  # undone with the failed attempt
            raise RuntimeError(f"step {self.fail_at} fails once")
        if self.i == self.gate_at:
            with open(f"{self.log}.entered", "w"):
                pass
            while not os.path.exists(self.gate):
                time.sleep(0.005)
        with open(self.log, "a") as f:
            f.write(f"{self.i}\n")
        self.i += 1

    def definition(self) -> Section:
        return S(For("steps", self.i < self.n, Step("work", self.work)))
