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
        self._kept: tuple[Any] | None = None

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

    def keep(self, value: Any) -> None:
        """Hold an answer back until `release` (once what it acknowledges is durable)."""
        self._kept = (value,)

    def release(self) -> bool:
        """Answer with the value held back by `keep`; False if there was none."""
        if self._kept is None:
            return False
        (value,), self._kept = self._kept, None
        self.set(value)
        return True

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
