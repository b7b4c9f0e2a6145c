"""Workflows that try to stall the daemon: input it cannot keep, code that breaks, hung steps."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from daemon import Go, On, S, Section, Step, Wait, Workflow
from handlers import Signal


@dataclass
class Keeper(Workflow):
    """Keeps whatever `put` brings in `kept`; `tangle` makes its data hold itself."""

    kept: dict[str, Any] = field(default_factory=dict)

    def put(self, value: Any) -> str:
        self.kept["value"] = value
        return "kept"

    def tangle(self) -> str:
        loop: list[Any] = []
        loop.append(loop)  # no JSON encoder can write this down: the save must fail
        self.kept["loop"] = loop
        return "tangled"

    def definition(self) -> Section:
        return S(
            Wait(
                "keep",
                On("put", Signal(self.put)),
                On("tangle", Signal(self.tangle)),
                On("done", Signal()),
            )
        )


@dataclass
class Brittle(Workflow):
    """Its `break_it` event makes `definition()` raise while a second thread waits.

    After the event the runtime re-arms the other thread's wait, which builds the
    definition: that raises between taking the event and saving it.
    """

    broken: bool = False

    def breaks(self) -> str:
        self.broken = True
        return "broken"

    def definition(self) -> Section:
        if self.broken:
            raise RuntimeError("definition() broken by the data")
        return S(
            Go("side", S(Wait("idle", On("poke", Signal(lambda: "poked"))))),
            Wait("main", On("break_it", Signal(self.breaks)), On("done", Signal())),
        )


@dataclass
class Stuck(Workflow):
    """Runs one sync step that blocks until the file `gate` exists, then waits for `done`.

    With `timeout` the step is given up after that many seconds and retried; each run of
    the step appends a line to the file `runs` (if set), so a test counts the attempts.
    `hold_s` bounds the block, so no thread outlives the test by long.
    """

    gate: str = ""
    runs: str = ""
    timeout: float | None = None
    hold_s: float = 30.0
    passed: bool = False

    def hold(self) -> None:
        if self.runs:
            with open(self.runs, "a") as f:
                f.write("run\n")
        deadline = time.monotonic() + self.hold_s
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.passed = True

    def definition(self) -> Section:
        return S(
            Step("hold", self.hold, timeout=self.timeout),
            Wait("after", On("done", Signal())),
        )


@dataclass
class Quick(Workflow):
    """Runs one short sync step, then finishes."""

    ran: bool = False

    def run(self) -> None:
        self.ran = True

    def definition(self) -> Section:
        return S(Step("quick", self.run))
