"""Work queued for one workflow's actor, and the reply its sender waits for."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from daemon.core.handler import CallbackRequest


class Reply:
    """The answer to one queued request, awaited by whoever queued it."""

    def __init__(self) -> None:
        # asyncio's event, not anyio's: one is made per request, and anyio looks its backend up
        # on every Event it makes (the daemon runs on asyncio only).
        self._done = asyncio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def answered(self) -> bool:
        """Tell whether the answer is in; the first answer given is the one that counts."""
        return self._done.is_set()

    def set(self, value: Any) -> None:
        """Answer with a value, unless already answered."""
        if not self.answered:
            self._value = value
            self._done.set()

    def fail(self, error: BaseException) -> None:
        """Answer with an error, unless already answered."""
        if not self.answered:
            self._error = error
            self._done.set()

    async def wait(self) -> Any:
        """Return the answer, or raise its error."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(slots=True)
class Item:
    """Work for an actor: "resume", "callback", "cancel" or "listen_failed".

    "listen_failed" carries the wait's request and, as input, the error text.
    """

    kind: str
    req: CallbackRequest | None = None
    input: Any = None
    reply: Reply | None = None
    inbox_id: int | None = None
