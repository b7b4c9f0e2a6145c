"""A stretch of one task's code that another may interrupt: a plain task cancel, caught at its end."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self


class Interruptible:
    """Lets other code interrupt the task running the block; the block then ends quietly.

    What anyio's CancelScope does for an actor's resume, for a fraction of its cost (~10 µs
    per task on its first scope: anyio keeps per-task state in a WeakKeyDictionary): a
    `cancel()` cancels the task, and the CancelledError it raises inside the block is
    swallowed at the block's end. A cancel of the task by anyone else (shutdown) goes on
    out of the block. Use it as `async with region:`, once; `cancelled_caught` tells whether
    the block was interrupted.
    """

    __slots__ = ("_cancelled", "_task", "cancelled_caught")

    def __init__(self) -> None:
        self._task: asyncio.Task[object] | None = None
        self._cancelled = False
        self.cancelled_caught = False

    def cancel(self) -> None:
        """Interrupt the block if it is running (and was not interrupted yet)."""
        if self._task is not None and not self._cancelled:
            self._cancelled = True
            self._task.cancel()

    async def __aenter__(self) -> Self:
        self._task = asyncio.current_task()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        task, self._task = self._task, None
        if not self._cancelled or task is None:
            return False
        if exc_type is None:
            # Cancelled, yet the block ended on its own: code in it swallowed the
            # CancelledError, or it was never delivered. Take it here, where it is ours, so
            # that no cancel is left pending for the code after the block.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                if task.uncancel() == 0:
                    self.cancelled_caught = True
                    return True
                raise  # another cancel came with ours
            task.uncancel()
            return False
        left = task.uncancel()
        if issubclass(exc_type, asyncio.CancelledError) and left == 0:
            self.cancelled_caught = True
            return True  # ours alone: nobody else asked the task to stop
        return False
