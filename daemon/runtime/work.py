"""Work queued for one workflow's actor, and the reply its sender waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.core.handler import CallbackRequest


class Reply:
    """The answer to one queued request, awaited by whoever queued it (or handed to `then`)."""

    __slots__ = ("_answered", "_done", "_error", "_kept", "_then", "_value")

    def __init__(self) -> None:
        self._answered = False
        # Made only when someone awaits: a sender answered through `then` needs no event (and
        # asyncio's, not anyio's, which looks its backend up on every Event it makes).
        self._done: asyncio.Event | None = None
        self._value: Any = None
        self._error: BaseException | None = None
        self._kept: tuple[Any] | None = None
        self._then: Callable[[], None] | None = None

    @property
    def answered(self) -> bool:
        """Tell whether the answer is in; the first answer given is the one that counts."""
        return self._answered

    def set(self, value: Any) -> None:
        """Answer with a value, unless already answered."""
        if not self._answered:
            self._value = value
            self._finish()

    def fail(self, error: BaseException) -> None:
        """Answer with an error, unless already answered."""
        if not self._answered:
            self._error = error
            self._finish()

    def _finish(self) -> None:
        self._answered = True
        if self._done is not None:
            self._done.set()
        then, self._then = self._then, None
        if then is not None:
            then()

    def then(self, callback: Callable[[], None]) -> None:
        """Call `callback` once this reply is answered (at once if it is already).

        It runs inside whoever answers (an actor committing a callback): it must not raise.
        A reply has one such callback (its one sender); a later call replaces it.
        """
        if self._answered:
            callback()
        else:
            self._then = callback

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

    def result(self) -> Any:
        """Return the answer given, or raise its error (only once answered)."""
        if self._error is not None:
            raise self._error
        return self._value

    async def wait(self) -> Any:
        """Return the answer, or raise its error."""
        if not self._answered:
            if self._done is None:
                self._done = asyncio.Event()
            await self._done.wait()
        return self.result()


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
