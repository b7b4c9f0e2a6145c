"""Workflows the chain tests run inside a real daemon: runs of steps of each kind.

Each step appends its name to the file `log` before it records itself in `ran`, so a test can
tell which steps ran, how often, and which of those the durable data holds.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from functools import partial

from daemon import S, Section, Step, Workflow


@dataclass
class KindsInTurn(Workflow):
    """Runs `n` steps by name s0, s1, ...: sync, async and inline in turn, each `rounds` times.

    Step `fail_at` fails once (it leaves the file `<log>.failed`), after changing the data;
    step `gate_at` waits for the file `gate` (it leaves `<log>.entered` first).
    """

    n: int = 30
    rounds: int = 3
    log: str = ""
    gate: str = ""
    fail_at: int = -1
    gate_at: int = -1
    ran: list[str] = field(default_factory=list)
    #: The steps that ran in a thread other than the daemon's loop.
    in_threads: list[str] = field(default_factory=list)

    def work(self, i: int) -> None:
        name = f"s{i}"
        with open(self.log, "a") as f:
            f.write(f"{name}\n")
        if i == self.fail_at and not os.path.exists(f"{self.log}.failed"):
            with open(f"{self.log}.failed", "w"):
                pass
            self.ran.append("lost")  # undone with the failed attempt
            raise RuntimeError(f"step {name} fails once")
        if i == self.gate_at:
            with open(f"{self.log}.entered", "w"):
                pass
            while not os.path.exists(self.gate):
                time.sleep(0.005)
        if threading.current_thread() is not threading.main_thread():
            self.in_threads.append(name)
        self.ran.append(name)

    async def work_async(self, i: int) -> None:
        self.work(i)

    def definition(self) -> Section:
        steps = []
        for i in range(self.n):
            kind = (i // self.rounds) % 3
            if kind == 0:
                steps.append(Step(f"s{i}", partial(self.work, i)))
            elif kind == 1:
                steps.append(Step(f"s{i}", partial(self.work_async, i)))
            else:
                steps.append(Step(f"s{i}", partial(self.work, i), inline=True))
        return S(*steps)
