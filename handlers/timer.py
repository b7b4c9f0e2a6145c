"""Timer: a Wait case that fires once an absolute deadline has passed.

The deadline is computed once, at setup, and stored in the setup data, so a
daemon restart re-arms the same deadline; one that passed while the daemon was
down fires at once. The runtime keeps one heap for every timer, so a Timer
holds no task of its own.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import msgspec

from daemon.clock import get_clock
from daemon.core.handler import CallbackRequest


class Timer:
    """Fires `after` seconds from setup, or `at` a point in time (a datetime or epoch seconds).

    A naive `datetime` is read as local time (as `datetime.timestamp()` does);
    an aware one is converted from its own time zone.
    """

    type = "timer"
    #: Setup only computes the deadline; the runtime arms it once saved (engine.QUIET_SETUP).
    quiet_setup = True

    def __init__(self, after: float | None = None, at: datetime | float | None = None) -> None:
        if (after is None) == (at is None):
            raise ValueError("Timer needs exactly one of after= or at=")
        if after is not None and not (math.isfinite(after) and after >= 0):
            raise ValueError(f"Timer(after=) must be a finite number >= 0, not {after!r}")
        if at is not None and not isinstance(at, datetime) and not math.isfinite(at):
            raise ValueError(f"Timer(at=) must be a datetime or finite epoch seconds, not {at!r}")
        self.after = after
        self.at = at

    async def setup(self, req: CallbackRequest) -> str:
        """Compute the absolute deadline and store it."""
        if self.after is not None:
            deadline = get_clock().now() + self.after
        elif isinstance(self.at, datetime):
            deadline = self.at.timestamp()
        else:
            deadline = float(self.at or 0.0)
        return msgspec.json.encode({"deadline": deadline}).decode()

    def deadline(self, req: CallbackRequest) -> float:
        """Return the deadline stored by `setup` in `req.setup_data`."""
        try:
            return _setup_data.decode(req.setup_data).deadline
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"bad timer setup data {req.setup_data!r}: {e}") from e

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Return the input the runtime delivered: `{"deadline": ..., "fired_at": ...}`."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Do nothing: the runtime drops the deadline from its heap."""


class _SetupData(msgspec.Struct):
    """What `Timer.setup` stores: the absolute deadline, in epoch seconds."""

    deadline: float


# Typed: re-arming decodes it after every callback of a workflow that waits on a timer.
_setup_data = msgspec.json.Decoder(_SetupData)
