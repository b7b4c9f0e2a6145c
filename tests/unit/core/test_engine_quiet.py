"""The checkpoint after a resume's last step: durable first unless the waits set up are quiet."""

from __future__ import annotations

from dataclasses import dataclass

from daemon import CheckpointType, On, S, Section, Step, Wait, Workflow
from handlers import Signal, Timer
from tests.helpers.support import Driver, Recorder


@dataclass
class StepThenSignal(Workflow):
    """A step, then a wait for a signal."""

    done: bool = False

    def mark(self) -> None:
        self.done = True

    def definition(self) -> Section:
        return S(Step("mark", self.mark), Wait("w", On("go", Signal())))


@dataclass
class StepThenTimerOrLoud(Workflow):
    """A step, then a wait with a timer and a case whose handler is not quiet."""

    done: bool = False

    def mark(self) -> None:
        self.done = True

    def definition(self) -> Section:
        return S(
            Step("mark", self.mark),
            Wait("w", On("ring", Timer(after=60)), On("loud", Recorder())),
        )


@dataclass
class StepThenTimer(Workflow):
    """A step, then a timer."""

    done: bool = False

    def mark(self) -> None:
        self.done = True

    def definition(self) -> Section:
        return S(Step("mark", self.mark), Wait("w", On("ring", Timer(after=60))))


async def test_a_step_before_quiet_waits_needs_no_durable_checkpoint() -> None:
    """Signals and timers set up nothing outside: the step is saved with them, after resume."""
    for wf in (StepThenSignal(), StepThenTimer()):
        d = Driver(wf)
        await d.resume()
        assert wf.done
        assert CheckpointType.AFTER_STEP not in d.checkpoints, type(wf).__name__
        assert CheckpointType.AFTER_SETUP in d.checkpoints


async def test_one_handler_that_is_not_quiet_makes_the_step_durable_first() -> None:
    """A wait case whose setup may tell the outside gets the step's durable checkpoint first."""
    d = Driver(StepThenTimerOrLoud())
    await d.resume()
    after_step = d.checkpoints.index(CheckpointType.AFTER_STEP)
    assert after_step < d.checkpoints.index(CheckpointType.AFTER_SETUP)
