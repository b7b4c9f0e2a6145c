"""Workflows the timer tests run inside a real workflowd: timers that re-arm, and sleepers."""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from daemon import For, On, S, Section, Step, Wait, Workflow
from daemon.core.handler import CallbackRequest
from handlers import Timer


@dataclass
class Metronome(Workflow):
    """Ticks `beats` times on a short timer, counting in the timer's own handler: no steps.

    Each beat is a fired timer whose callback re-arms the next one, so it shows what a fired
    timer costs in writes and nothing else.
    """

    beats: int = 5
    every_s: float = 0.02
    ticked: int = 0

    def tick(self) -> None:
        self.ticked += 1

    def timer(self) -> Timer:
        timer = Timer(after=self.every_s)

        async def handle(req: CallbackRequest, input: Any) -> Any:
            self.tick()
            return input

        timer.handle = handle  # type: ignore[method-assign] # a per-instance wrapper
        return timer

    def definition(self) -> Section:
        return S(For("beat", self.ticked < self.beats, Wait("w", On("tick", self.timer()))))


@dataclass
class Dozer(Workflow):
    """Sleeps until `at` (epoch seconds); counts its timer's fires in the timer's handler.

    The count is saved with the callback, so a timer that fired twice for one wait shows
    `rang == 2`; the step after it records when it ran (a step may run twice across a kill).
    """

    at: float = 0.0
    rang: int = 0
    fired_at: float = 0.0
    woke_at: float = 0.0

    def alarm(self) -> Timer:
        timer = Timer(at=self.at)

        async def handle(req: CallbackRequest, input: Any) -> Any:
            self.rang += 1
            self.fired_at = float(input["fired_at"])
            return input

        timer.handle = handle  # type: ignore[method-assign] # a per-instance wrapper
        return timer

    def wake(self) -> None:
        self.woke_at = time.time()

    def definition(self) -> Section:
        return S(Wait("nap", On("alarm", self.alarm())), Step("woke", self.wake))


#: What Litterbug's timers leave behind: each fire's cycle stays here for LITTER_KEPT fires,
#: long enough to reach the collector's old generation before it becomes garbage.
LITTER: deque[list[Any]] = deque()
LITTER_KEPT = 200


@dataclass
class Litterbug(Metronome):
    """Ticks like Metronome, and each fire leaves a reference cycle (~3 KB) that only a full
    collection can free once it is dropped: it stays referenced for LITTER_KEPT fires first.
    """

    every_s: float = 0.001

    def tick(self) -> None:
        super().tick()
        cycle: list[Any] = [[i] for i in range(30)]
        cycle.append(bytes(2048))
        cycle.append(cycle)
        LITTER.append(cycle)
        if len(LITTER) > LITTER_KEPT:
            LITTER.popleft()


@dataclass
class SlowWaker(Workflow):
    """Sleeps until `at`, then runs one step that blocks until the file `gate` exists.

    Each run of the step appends a line to `gate`.runs first, so a test sees it started (and
    how often it ran across a kill). The block is bounded by `hold_s`.
    """

    at: float = 0.0
    gate: str = ""
    hold_s: float = 30.0
    opened: bool = False

    def pass_gate(self) -> None:
        with open(f"{self.gate}.runs", "a") as runs:
            runs.write("ran\n")
        deadline = time.monotonic() + self.hold_s
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        self.opened = os.path.exists(self.gate)

    def definition(self) -> Section:
        return S(Wait("nap", On("alarm", Timer(at=self.at))), Step("gate", self.pass_gate))
