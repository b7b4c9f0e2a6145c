"""Workflows the daemon benchmarks run, in process and inside a real workflowd."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from daemon import For, Go, On, S, Section, Step, Wait, WaitFor, Workflow
from handlers import Signal, Timer


@dataclass
class SyncSteps(Workflow):
    """Runs `n` trivial synchronous steps (each in a worker thread) in a loop."""

    n: int = 10
    i: int = 0

    def inc(self) -> None:
        self.i += 1

    def definition(self) -> Section:
        return S(For("loop", self.i < self.n, Step("inc", self.inc)))


@dataclass
class AsyncSteps(Workflow):
    """Runs `n` trivial async steps (on the event loop) in a loop."""

    n: int = 10
    i: int = 0

    async def inc(self) -> None:
        self.i += 1

    def definition(self) -> Section:
        return S(For("loop", self.i < self.n, Step("inc", self.inc)))


@dataclass
class Pinged(Workflow):
    """Waits for a "ping" signal forever; each one is one durable callback."""

    count: int = 0

    def ping(self, value: int | None = None) -> int:
        self.count += 1
        return self.count

    def definition(self) -> Section:
        return S(For("loop", True, Wait("wait", On("ping", Signal(self.ping)))))


@dataclass
class Alarm(Workflow):
    """Waits for a timer due `at` (epoch seconds), then records how late the next step ran."""

    at: float = 0.0
    late_s: float = -1.0

    def measure(self) -> None:
        self.late_s = time.time() - self.at

    def definition(self) -> Section:
        return S(
            Wait("sleep", On("ring", Timer(at=self.at))),
            Step("measure", self.measure),
        )


@dataclass
class Stamp(Workflow):
    """Records when its first step ran (epoch seconds): a scheduled start, end to end."""

    started_at: float = 0.0

    async def stamp(self) -> None:
        self.started_at = time.time()

    def definition(self) -> Section:
        return S(Step("stamp", self.stamp))


@dataclass
class FanSteps(Workflow):
    """Starts `threads` Go threads; each runs `n` trivial sync steps, counting its own slot."""

    threads: int = 64
    n: int = 10
    counts: list[int] = field(default_factory=list)

    def inc(self, j: int) -> None:
        self.counts[j] += 1

    def start(self) -> None:
        self.counts = [0] * self.threads

    def definition(self) -> Section:
        go = [
            Go(
                f"t{j}",
                For(f"loop{j}", self.counts[j] < self.n, Step(f"inc{j}", partial(self.inc, j))),
            )
            for j in range(len(self.counts))
        ]
        return S(
            Step("start", self.start),
            *go,
            WaitFor("joined", all(c >= self.n for c in self.counts)),
        )


@dataclass
class Ticking(Workflow):
    """Fires `beats` timers in a row, each `every_s` after the last, and takes no step.

    The timer's handler counts the beats, so each fire costs its callback and the re-arm of
    the next timer, nothing else: what a fired timer costs the daemon.
    """

    beats: int = 10
    every_s: float = 0.05
    ticked: int = 0

    def tick(self) -> Timer:
        timer = Timer(after=self.every_s)

        # Timer.handle returns its input; wrapping the bound method instead would make the
        # timer a reference cycle (timer -> wrapper -> bound method -> timer) per fire.
        async def handle(req: Any, input: Any) -> Any:
            self.ticked += 1
            return input

        timer.handle = handle  # type: ignore[method-assign] # a per-instance wrapper
        return timer

    def definition(self) -> Section:
        return S(For("beat", self.ticked < self.beats, Wait("w", On("tick", self.tick()))))
