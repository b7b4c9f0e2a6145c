"""Every error workflowd raises; each carries a stable `code` for the control protocol."""

from __future__ import annotations


class WorkflowdError(Exception):
    """Unexpected workflowd error."""

    code = "internal"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        """Return the human-readable message."""
        return str(self)


#: The root's name before 0.2, kept so code written against it still works.
WorkflowError = WorkflowdError


class ValidationError(WorkflowdError):
    """The workflow definition is invalid."""

    code = "invalid_definition"


class UnknownStatement(WorkflowdError):
    """The definition holds an object that is not a statement."""

    code = "invalid_definition"


class StepNotFound(WorkflowdError):
    """A thread stopped at a statement that no longer exists in the definition."""

    code = "invalid_definition"


class StepFailed(WorkflowdError):
    """A step's action raised."""

    def __init__(self, step: str, cause: BaseException) -> None:
        super().__init__(f"step {step!r} failed: {type(cause).__name__}: {cause}")
        self.step = step
        self.cause = cause


class RunawayWorkflow(WorkflowdError):
    """The workflow made too many transitions without blocking (an endless loop?)."""


class CallbackNotFound(WorkflowdError):
    """No thread of the workflow waits for that event."""

    code = "not_found"


class StaleCallback(WorkflowdError):
    """The callback's pc does not match the wait it addresses (it is from an earlier wait)."""

    code = "stale"


class HandlerRejected(WorkflowdError):
    """The event's handler rejected the input; the workflow is unchanged."""

    code = "bad_input"


class WorkflowNotFound(WorkflowdError):
    """No workflow has that id."""

    code = "not_found"


class ScheduleNotFound(WorkflowdError):
    """No schedule has that name."""

    code = "not_found"


class UnknownWorkflowType(WorkflowdError):
    """No workflow class is registered under that name."""

    code = "not_found"


class Conflict(WorkflowdError):
    """The request conflicts with the workflow's current state."""

    code = "conflict"


class BadRequest(WorkflowdError):
    """The request is malformed."""

    code = "bad_request"


class Unavailable(WorkflowdError):
    """The daemon is shutting down or cannot serve the request now."""

    code = "unavailable"


class StoreLocked(WorkflowdError):
    """Another workflowd process holds this database."""


class StoreUnusable(WorkflowdError):
    """The database, or a file or folder beside it, cannot be opened for writing."""


class ConfigError(WorkflowdError):
    """The configuration is invalid."""


class BadInput(WorkflowdError):
    """The value does not fit the workflow's data types."""

    code = "bad_input"
