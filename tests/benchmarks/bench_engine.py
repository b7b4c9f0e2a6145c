"""The seed's own engine benchmark: a loop workflow driven in memory with a no-op checkpoint."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from daemon import (
    CallbackRequest,
    CheckpointType,
    For,
    On,
    S,
    Section,
    State,
    Step,
    Wait,
    Workflow,
    WorkflowStatus,
    handle_callback,
    resume,
)

#: The Go seed runs this workflow in about 20 µs; we aim for 5x that on one core.
TARGET_US_PER_RUN = 100.0
RUNS = 2_000
REPEATS = 5


class NoopSignal:
    """A minimal Signal-like handler: nothing to arm or release, the input is the reply."""

    type = "signal"

    async def setup(self, req: CallbackRequest) -> str:
        """Arm nothing."""
        return ""

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Echo the input."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Release nothing."""


SIGNAL = NoopSignal()


@dataclass
class LoopWorkflow(Workflow):
    """Five counted steps, a reset, then two rounds of wait-for-a-signal and a step."""

    i: int = 0

    def inc(self) -> None:
        """Count one."""
        self.i += 1

    def reset(self) -> None:
        """Start counting again."""
        self.i = 0

    def definition(self) -> Section:
        return S(
            For("count", self.i < 5, Step("inc", self.inc)),
            Step("reset", self.reset),
            For(
                "signals",
                self.i < 2,
                Wait("wait", On("signal", SIGNAL)),
                Step("after", self.inc),
            ),
        )


class _Counter:
    """A no-op checkpoint that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, kind: CheckpointType) -> None:
        self.calls += 1


async def run_once(save: _Counter) -> tuple[LoopWorkflow, State]:
    """Run the loop workflow from start to finish: resume, then two callbacks each resumed."""
    wf = LoopWorkflow()
    state = State.new("bench", LoopWorkflow.name)
    await resume(wf, state, save)
    for _ in range(2):
        await handle_callback(CallbackRequest(name="signal"), wf, state, None)
        await resume(wf, state, save)
    return wf, state


async def _timed(runs: int, save: _Counter) -> float:
    start = time.perf_counter()
    for _ in range(runs):
        await run_once(save)
    return time.perf_counter() - start


async def run(runs: int = RUNS, repeats: int = REPEATS) -> list[dict[str, Any]]:
    """Measure µs per run and per transition (a transition is one checkpoint call)."""
    probe = _Counter()
    wf, state = await run_once(probe)
    if state.status is not WorkflowStatus.FINISHED or wf.i != 2:
        raise AssertionError(f"loop workflow ended {state.status} with i={wf.i}")
    checkpoints, pc = probe.calls, state.pc
    await _timed(max(runs // 10, 1), _Counter())  # warm-up
    times = [await _timed(runs, _Counter()) / runs * 1e6 for _ in range(repeats)]
    per_run, best = statistics.median(times), min(times)
    bench, target = "engine_loop", TARGET_US_PER_RUN
    return [
        {"bench": bench, "metric": "per_run", "value": round(per_run, 1), "unit": "us",
         "target": target},
        {"bench": bench, "metric": "per_run_best", "value": round(best, 1), "unit": "us",
         "target": target},
        {"bench": bench, "metric": "per_transition", "value": round(per_run / checkpoints, 2),
         "unit": "us", "target": round(target / checkpoints, 2)},
        {"bench": bench, "metric": "transitions_per_run", "value": checkpoints,
         "unit": "checkpoints", "target": None},
        {"bench": bench, "metric": "pc_per_run", "value": pc, "unit": "pc", "target": None},
    ]  # fmt: skip
