"""Every error workflowd raises; each carries a stable `code` for the control protocol."""

from __future__ import annotations


class WorkflowError(Exception):
    """Unexpected workflowd error."""

    code = "internal"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        """Return the human-readable message."""
        return str(self)


class ValidationError(WorkflowError):
    """The workflow definition is invalid."""

    code = "invalid_definition"


class UnknownStatement(WorkflowError):
    """The definition holds an object that is not a statement."""

    code = "invalid_definition"


class StepNotFound(WorkflowError):
    """A thread stopped at a statement that no longer exists in the definition."""

    code = "invalid_definition"


class StepFailed(WorkflowError):
    """A step's action raised."""

    def __init__(self, step: str, cause: BaseException) -> None:
        super().__init__(f"step {step!r} failed: {type(cause).__name__}: {cause}")
        self.step = step
        self.cause = cause


class RunawayWorkflow(WorkflowError):
    """The workflow made too many transitions without blocking (an endless loop?)."""


class CallbackNotFound(WorkflowError):
    """No thread of the workflow waits for that event."""

    code = "not_found"


class StaleCallback(WorkflowError):
    """The callback's pc does not match the wait it addresses (it is from an earlier wait)."""

    code = "stale"


class HandlerRejected(WorkflowError):
    """The event's handler rejected the input; the workflow is unchanged."""

    code = "bad_input"


class WorkflowNotFound(WorkflowError):
    """No workflow has that id."""

    code = "not_found"


class UnknownWorkflowType(WorkflowError):
    """No workflow class is registered under that name."""

    code = "not_found"


class Conflict(WorkflowError):
    """The request conflicts with the workflow's current state."""

    code = "conflict"


class BadRequest(WorkflowError):
    """The request is malformed."""

    code = "bad_request"


class Unavailable(WorkflowError):
    """The daemon is shutting down or cannot serve the request now."""

    code = "unavailable"


class StoreLocked(WorkflowError):
    """Another workflowd process holds this database."""


class ConfigError(WorkflowError):
    """The configuration is invalid."""


class BadInput(WorkflowError):
    """The value does not fit the workflow's data types."""

    code = "bad_input"
