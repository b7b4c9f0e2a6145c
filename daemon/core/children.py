"""What a Child case needs of the runtime: start a workflow, learn how it ended, cancel it.

Handlers are built by workflow code inside `definition()`, so they cannot be handed the
runtime; like the clock, the running daemon's implementation is found through a context
variable that the runtime sets for every task it starts.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

from daemon.errors import Unavailable


class Children(Protocol):
    """Starts, watches and cancels the child workflows of Child cases."""

    async def start(
        self, *, parent: str, workflow: str, workflow_id: str, input: dict[str, Any] | None
    ) -> None:
        """Start `workflow` as a child of `parent`; an existing id is left as it is."""
        ...

    async def outcome(self, workflow_id: str) -> dict[str, Any]:
        """Wait until the workflow has ended; return `{workflow_id, status, result, error}`."""
        ...

    async def cancel(self, workflow_id: str) -> None:
        """Cancel the workflow if it still runs (its own children follow their policy)."""
        ...


class _Absent:
    """Stands in when no runtime runs (a unit test of the engine alone)."""

    async def start(
        self, *, parent: str, workflow: str, workflow_id: str, input: dict[str, Any] | None
    ) -> None:
        raise Unavailable("child workflows need a running workflowd")

    async def outcome(self, workflow_id: str) -> dict[str, Any]:
        raise Unavailable("child workflows need a running workflowd")

    async def cancel(self, workflow_id: str) -> None:
        raise Unavailable("child workflows need a running workflowd")


_current: contextvars.ContextVar[Children] = contextvars.ContextVar("workflowd_children")
_absent = _Absent()


def get_children() -> Children:
    """Return the running daemon's child-workflow service."""
    return _current.get(_absent)


def use_children(children: Children) -> contextvars.Token[Children]:
    """Make `children` the service for this context and the tasks it starts."""
    return _current.set(children)
