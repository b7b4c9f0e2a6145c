"""Workflows the timer tests run inside a real workflowd: timers that re-arm, and sleepers."""

from __future__ import annotations

import time
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

    def timer(self) -> Timer:
        timer = Timer(after=self.every_s)

        async def handle(req: CallbackRequest, input: Any) -> Any:
            self.ticked += 1
            return input

        timer.handle = handle  # type: ignore[method-assign] # a per-instance wrapper
        return timer

    def definition(self) -> Section:
        return S(For("beat", self.ticked < self.beats, Wait("w", On("tick", self.timer()))))


@dataclass
class Sleeper(Workflow):
    """Sleeps until `at` (epoch seconds), then records when it woke and how often."""

    at: float = 0.0
    woke_at: float = 0.0
    woken: int = 0

    def wake(self) -> None:
        self.woke_at = time.time()
        self.woken += 1

    def definition(self) -> Section:
        return S(Wait("nap", On("alarm", Timer(at=self.at))), Step("woke", self.wake))
