"""The engine's durable bookkeeping: workflow, thread and wait-event state and their statuses."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from daemon.core.handler import CallbackRequest

MAIN_THREAD = "_main_"


class WorkflowStatus(StrEnum):
    """Where a workflow is in its life."""

    #: At least one thread can make progress.
    RESUMING = "Resuming"
    #: Every thread waits for an event or a condition.
    WAITING = "Waiting"
    #: The main thread ended.
    FINISHED = "Finished"
    #: A step failed for good.
    FAILED = "Failed"
    #: An operator or program cancelled it.
    CANCELLED = "Cancelled"


class ThreadStatus(StrEnum):
    """What a thread does next."""

    #: Run the step `cur_step`.
    EXECUTING = "Executing"
    #: Continue after `cur_step`.
    RESUMING = "Resuming"
    #: Wait for one of the events of the Wait `cur_step`.
    WAITING_EVENT = "WaitingEvent"
    #: Wait for the condition of the WaitFor `cur_step`.
    WAITING_CONDITION = "WaitingCondition"


class EventStatus(StrEnum):
    """Where a wait event is between setup and teardown."""

    #: Created; its handler's setup has not run yet.
    PENDING_SETUP = "PendingSetup"
    #: Armed.
    SETUP = "Setup"
    #: No longer needed; its handler's teardown has not run yet.
    PENDING_TEARDOWN = "PendingTeardown"
    #: Setup raised; retried on the next resume.
    SETUP_ERROR = "SetupError"
    #: Teardown raised; retried on the next resume.
    TEARDOWN_ERROR = "TeardownError"


class CheckpointType(StrEnum):
    """The points at which `resume` asks for a checkpoint."""

    AFTER_STEP = "afterStep"
    AFTER_SETUP = "afterSetup"
    AFTER_TEARDOWN = "afterTeardown"
    AFTER_RESUME = "afterResume"
    AFTER_CONDITION = "afterCondition"
    #: Steps were started (and none completed since the last checkpoint).
    STEPS_STARTED = "stepsStarted"


FINAL_STATUSES = frozenset(
    {WorkflowStatus.FINISHED, WorkflowStatus.FAILED, WorkflowStatus.CANCELLED}
)
ARMED = (EventStatus.SETUP, EventStatus.PENDING_SETUP)
#: Thread statuses that can make progress.
RUNNABLE = (ThreadStatus.EXECUTING, ThreadStatus.RESUMING)
#: Event statuses whose handler's setup is due (again).
SETUP_DUE = (EventStatus.PENDING_SETUP, EventStatus.SETUP_ERROR)
#: Event statuses whose handler's teardown is due (again).
TEARDOWN_DUE = (EventStatus.PENDING_TEARDOWN, EventStatus.TEARDOWN_ERROR)
#: Event statuses whose handler must be torn down once the wait is over.
RELEASED = (EventStatus.SETUP, EventStatus.SETUP_ERROR)


@dataclass(slots=True)
class WaitEvent:
    """One case of a Wait a thread blocks on."""

    type: str
    req: CallbackRequest
    status: EventStatus = EventStatus.PENDING_SETUP
    handled: bool = False
    error: str = ""


@dataclass(slots=True)
class Thread:
    """One line of execution through the definition."""

    id: str
    name: str
    status: ThreadStatus = ThreadStatus.RESUMING
    cur_step: str = ""
    cur_callback: str = ""
    wait_events: list[WaitEvent] = field(default_factory=list)
    pc: int = 0


@dataclass(slots=True)
class State:
    """The engine's durable bookkeeping for one workflow instance."""

    id: str
    workflow: str
    status: WorkflowStatus = WorkflowStatus.RESUMING
    threads: list[Thread] = field(default_factory=list)
    pc: int = 0

    @classmethod
    def new(cls, id: str, workflow: str) -> State:
        """Return the state of a workflow that has not run yet."""
        return cls(id, workflow, _RESUMING, [Thread(MAIN_THREAD, MAIN_THREAD)])

    def to_json(self) -> str:
        """Serialize to JSON text."""
        return _encoder.encode(self).decode()

    @classmethod
    def from_json(cls, s: str | bytes) -> State:
        """Parse JSON text produced by `to_json`."""
        return _state_decoder.decode(s)

    def thread(self, id: str) -> Thread | None:
        """Return the thread with that id, or None."""
        for t in self.threads:
            if t.id == id:
                return t
        return None

    def update_status(self) -> None:
        """Derive RESUMING/WAITING from the threads (final statuses are kept)."""
        if self.status in FINAL_STATUSES:
            return
        # A loop, not any() over a generator: this runs after every resume and callback.
        for t in self.threads:
            if t.status in RUNNABLE:
                self.status = _RESUMING
                return
        self.status = _WAITING


# Module-level names for Enum members read on every resume (a class attribute of an Enum
# costs ~0.1 µs in Python 3.11).
_RESUMING, _WAITING = WorkflowStatus.RESUMING, WorkflowStatus.WAITING
_encoder = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(State)
