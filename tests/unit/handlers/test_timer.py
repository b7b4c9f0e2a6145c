"""Timer driven directly: setup computes the deadline from the injected clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest

from daemon.clock import FakeClock, use_clock
from daemon.core.handler import ActiveHandler, CallbackRequest, TimedHandler
from handlers import Timer


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    """Install a FakeClock as the current clock for the test."""
    fake = FakeClock(start=1_000.0)
    token = use_clock(fake)
    yield fake
    token.var.reset(token)


async def setup(timer: Timer) -> CallbackRequest:
    """Run setup and return a request carrying its setup data."""
    req = CallbackRequest("wf", "main", "case", 1)
    req.setup_data = await timer.setup(req)
    return req


class TestConstruction:
    def test_is_timed_not_active(self) -> None:
        """Timer is a TimedHandler and has no listen task."""
        timer = Timer(after=1)
        assert isinstance(timer, TimedHandler)
        assert not isinstance(timer, ActiveHandler)
        assert timer.type == "timer"

    @pytest.mark.parametrize(
        "kwargs", [{}, {"after": 1, "at": 2.0}, {"after": -1}, {"after": float("nan")}]
    )
    def test_rejects_bad_arguments(self, kwargs: dict[str, float]) -> None:
        """It needs exactly one of after/at, and a finite non-negative delay."""
        with pytest.raises(ValueError, match="Timer"):
            Timer(**kwargs)


class TestDeadline:
    async def test_after_uses_the_clock(self, clock: FakeClock) -> None:
        """`after` is added to the clock's time at setup and stored as JSON."""
        timer = Timer(after=5)
        req = await setup(timer)
        assert json.loads(req.setup_data) == {"deadline": 1_005.0}
        clock.advance(100)
        assert Timer(after=5).deadline(req) == 1_005.0  # a rebuilt Timer reads the same deadline

    async def test_at_epoch(self, clock: FakeClock) -> None:
        """A float `at` is an absolute epoch deadline, whatever the clock says."""
        assert Timer(at=42.5).deadline(await setup(Timer(at=42.5))) == 42.5

    async def test_at_aware_datetime(self) -> None:
        """An aware datetime is converted from its own time zone."""
        at = datetime(2030, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
        req = await setup(Timer(at=at))
        assert Timer(at=at).deadline(req) == datetime(2030, 1, 1, 10, 0, tzinfo=UTC).timestamp()

    async def test_at_naive_datetime_is_local(self) -> None:
        """A naive datetime is read as local time."""
        at = datetime(2030, 1, 1, 12, 0)
        req = await setup(Timer(at=at))
        assert Timer(at=at).deadline(req) == at.astimezone().timestamp()

    def test_bad_setup_data(self) -> None:
        """Unreadable setup data raises ValueError naming it."""
        with pytest.raises(ValueError, match="timer setup data"):
            Timer(after=1).deadline(CallbackRequest(setup_data="{}"))


class TestHandle:
    async def test_handle_returns_input_and_teardown_is_noop(self, clock: FakeClock) -> None:
        """handle returns what the runtime delivered; teardown does nothing."""
        timer = Timer(after=0)
        req = await setup(timer)
        fired = {"deadline": timer.deadline(req), "fired_at": clock.now()}
        assert await timer.handle(req, fired) == fired
        await timer.teardown(req, True)
        await timer.teardown(req, False)
