"""Time as an injected dependency: the real clock and a fake one for tests."""

from __future__ import annotations

import contextvars
import heapq
import itertools
import time
from typing import Protocol

import anyio


class Clock(Protocol):
    """Where handlers and the runtime read the time and wait for a deadline."""

    def now(self) -> float:
        """Return the current time in epoch seconds."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once `now()` has reached `deadline`."""
        ...


class SystemClock:
    """The wall clock."""

    def now(self) -> float:
        """Return `time.time()`."""
        return time.time()

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until the wall clock reaches `deadline`."""
        await anyio.sleep(max(0.0, deadline - time.time()))


class FakeClock:
    """A clock that moves only when a test calls `advance`."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._waiters: list[tuple[float, int, anyio.Event]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        """Return the fake time."""
        return self._now

    async def sleep_until(self, deadline: float) -> None:
        """Block until `advance` moves the fake time past `deadline`."""
        if deadline <= self._now:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        heapq.heappush(self._waiters, (deadline, next(self._seq), event))
        await event.wait()

    def advance(self, seconds: float) -> None:
        """Move the fake time forward and wake every sleeper now due."""
        self._now += seconds
        while self._waiters and self._waiters[0][0] <= self._now:
            heapq.heappop(self._waiters)[2].set()


_current: contextvars.ContextVar[Clock] = contextvars.ContextVar("workflowd_clock")
_system = SystemClock()


def get_clock() -> Clock:
    """Return the clock of the running daemon (the system clock by default)."""
    return _current.get(_system)


def use_clock(clock: Clock) -> contextvars.Token[Clock]:
    """Make `clock` the current clock for this context and the tasks it starts."""
    return _current.set(clock)
