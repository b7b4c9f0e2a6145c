"""Workflows the control-socket end-to-end tests run inside a real daemon."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from daemon import For, On, S, Section, Step, Wait, Workflow
from handlers import Signal


@dataclass
class Rename:
    """The input of Tally's `rename` event."""

    name: str


@dataclass
class Tally(Workflow):
    """Adds the numbers sent as `add`, one wait per loop turn, until `close`."""

    id: str = ""
    # Not `name`: a data field of that name would hide the registered type name (Workflow.name).
    label: str = ""
    total: int = 0
    seen: list[int] = field(default_factory=list)
    open: bool = True

    def add(self, n: Any) -> int:
        # Recorded before the check on purpose: the daemon must undo it when the check fails.
        self.seen.append(n)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"expected a non-negative integer, got {n!r}")
        self.total += n
        return self.total

    def rename(self, r: Rename) -> str:
        self.label = r.name
        return f"renamed to {r.name}"

    def close(self) -> None:
        self.open = False

    def definition(self) -> Section:
        return S(
            For(
                "loop",
                self.open,
                Wait(
                    "next",
                    On("add", Signal(self.add)),
                    On("rename", Signal(self.rename)),
                    On("close", Signal(self.close)),
                ),
            )
        )


@dataclass
class Hold(Workflow):
    """Runs one step that blocks until the file `gate` exists (bounded), then waits for `poke`."""

    gate: str = ""
    passed: bool = False

    def hold(self) -> None:
        deadline = time.monotonic() + 30
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.passed = True

    def definition(self) -> Section:
        return S(Step("hold", self.hold), Wait("after", On("poke", Signal(lambda: "poked"))))
