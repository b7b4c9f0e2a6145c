"""The handler contract: how a Wait case is armed, fired and released."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class CallbackRequest:
    """Addresses one case of one Wait of one thread; `pc` tells iterations apart."""

    workflow_id: str = ""
    thread_id: str = ""
    name: str = ""
    pc: int = 0
    setup_data: str = ""


#: Hands a callback input to the workflow and returns the handler's output once it is durable.
Deliver = Callable[[Any], Awaitable[Any]]


@runtime_checkable
class Handler(Protocol):
    """Arms, handles and releases one kind of event (the seed's Handler)."""

    type: str

    async def setup(self, req: CallbackRequest) -> str:
        """Arm the event and return the JSON text needed to re-arm it after a restart."""
        ...

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Apply the callback input to the workflow and return the reply."""
        ...

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Release whatever setup armed."""
        ...


@runtime_checkable
class ActiveHandler(Handler, Protocol):
    """A handler whose event comes from a task the runtime runs after setup."""

    async def listen(self, req: CallbackRequest, deliver: Deliver) -> None:
        """Wait for the event, then `await deliver(input)`; the runtime cancels it on teardown."""
        ...


@runtime_checkable
class TimedHandler(Handler, Protocol):
    """A handler that fires at a deadline; the runtime keeps one heap for all of them."""

    def deadline(self, req: CallbackRequest) -> float:
        """Return the absolute deadline (epoch seconds) stored in `req.setup_data`."""
        ...
