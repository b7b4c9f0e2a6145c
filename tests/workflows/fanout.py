"""Workflows whose Go threads run steps at the same time (e2e/test_fanout.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial

import anyio

from daemon import Go, NonRetryableError, S, Section, Step, WaitFor, Workflow
from tests.workflows.e2e import append_step_log

#: How long a gated step waits for its gate file at most (a test that forgets it still ends).
GATE_CEILING_S = 60.0


def _span(spans: dict[str, list[float]], key: str, began: float) -> None:
    spans[key] = [began, time.time()]


@dataclass
class FanOut(Workflow):
    """Starts `n` Go threads; each runs one step that sleeps `sleep_s` and appends its name."""

    n: int = 2
    sleep_s: float = 1.0
    use_async: bool = False
    #: Every thread appends its name here (the append merge).
    items: list[str] = field(default_factory=list)
    #: Every thread adds its own key (the dict merge): when its step began and ended.
    spans: dict[str, list[float]] = field(default_factory=dict)

    def work(self, k: int) -> None:
        began = time.time()
        append_step_log(f"work{k}")
        time.sleep(self.sleep_s)
        self.items.append(f"w{k}")
        _span(self.spans, f"w{k}", began)

    async def work_async(self, k: int) -> None:
        began = time.time()
        append_step_log(f"work{k}")
        await anyio.sleep(self.sleep_s)
        self.items.append(f"w{k}")
        _span(self.spans, f"w{k}", began)

    def definition(self) -> Section:
        act = self.work_async if self.use_async else self.work
        return S(
            *[Go(f"t{k}", Step(f"work{k}", partial(act, k))) for k in range(self.n)],
            WaitFor("joined", len(self.spans) == self.n),
        )


@dataclass
class OwnFields(Workflow):
    """Two threads that each write their own field, and two that race on the same one."""

    left: str = ""
    right: str = ""
    winner: str = ""
    #: When each step began and ended.
    spans: dict[str, list[float]] = field(default_factory=dict)

    def write(self, name: str, value: str, sleep_s: float) -> None:
        began = time.time()
        time.sleep(sleep_s)
        setattr(self, name, value)
        _span(self.spans, value, began)

    def definition(self) -> Section:
        return S(
            Go("l", Step("set_left", partial(self.write, "left", "L", 1.0))),
            Go("r", Step("set_right", partial(self.write, "right", "R", 1.0))),
            # Both change `winner` from its start; "late" completes last and wins.
            Go("e", Step("early", partial(self.write, "winner", "early", 0.5))),
            Go("z", Step("late", partial(self.write, "winner", "late", 1.5))),
            WaitFor("joined", len(self.spans) == 4),
        )


def _wait_gate(gate: str) -> None:
    deadline = time.monotonic() + GATE_CEILING_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


@dataclass
class GatedFan(Workflow):
    """Three threads: a quick step each, then a step that holds until the file `gate` exists."""

    gate: str = ""
    quick: list[str] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)

    def run_quick(self, k: int) -> None:
        append_step_log(f"quick{k}")
        self.quick.append(f"q{k}")

    def run_slow(self, k: int) -> None:
        append_step_log(f"slow{k}")
        _wait_gate(self.gate)
        self.slow.append(f"s{k}")

    def definition(self) -> Section:
        return S(
            *[
                Go(
                    f"g{k}",
                    S(
                        Step(f"quick{k}", partial(self.run_quick, k)),
                        Step(f"slow{k}", partial(self.run_slow, k)),
                    ),
                )
                for k in range(3)
            ],
            WaitFor("joined", len(self.slow) == 3),
        )


@dataclass
class OneFails(Workflow):
    """One thread fails for good while an async and a sync step of two others still run."""

    flaky_runs: int = 0
    notes: list[str] = field(default_factory=list)

    def doomed(self) -> None:
        time.sleep(0.3)
        self.notes.append("doomed")  # discarded: the step fails
        raise NonRetryableError("this thread cannot go on")

    async def long_async(self) -> None:
        append_step_log("async_began")
        await anyio.sleep(GATE_CEILING_S)
        append_step_log("async_ended")

    def long_sync(self) -> None:
        append_step_log("sync_began")
        time.sleep(3.0)
        append_step_log("sync_ended")

    def definition(self) -> Section:
        return S(
            Go("a", Step("long_async", self.long_async)),
            Go("s", Step("long_sync", self.long_sync)),
            Go("d", Step("doomed", self.doomed)),
            WaitFor("never", False),
        )


@dataclass
class Retried(Workflow):
    """A thread's step fails twice, then succeeds, while another thread's long step runs."""

    notes: list[str] = field(default_factory=list)
    spans: dict[str, list[float]] = field(default_factory=dict)

    def flaky(self) -> None:
        began = time.time()
        append_step_log("flaky")
        self.notes.append("flaky tried")  # kept only from the attempt that succeeds
        path = os.environ.get("E2E_STEP_LOG", "")
        with open(path) as f:
            tries = sum(1 for line in f if line.strip() == "flaky")
        if tries < 3:
            raise RuntimeError(f"attempt {tries} breaks")
        _span(self.spans, "flaky", began)

    def steady(self) -> None:
        began = time.time()
        append_step_log("steady")
        time.sleep(1.5)
        self.notes.append("steady")
        _span(self.spans, "steady", began)

    def definition(self) -> Section:
        return S(
            Go("f", Step("flaky", self.flaky)),
            Go("s", Step("steady", self.steady)),
            WaitFor("joined", len(self.spans) == 2),
        )
