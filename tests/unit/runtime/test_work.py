"""`Reply`: the answer to one queued request, awaited or handed to a callback."""

from __future__ import annotations

import pytest

from daemon.errors import Unavailable
from daemon.runtime.work import Reply


async def test_then_is_called_once_with_the_first_answer() -> None:
    """A callback set before the answer runs when it comes, once; later answers are ignored."""
    reply, seen = Reply(), []
    reply.then(lambda: seen.append(reply.result()))
    assert seen == []
    reply.set(1)
    reply.set(2)
    reply.fail(Unavailable("late"))
    assert seen == [1] and await reply.wait() == 1


async def test_then_after_the_answer_runs_at_once() -> None:
    """A callback set on an answered reply runs at once."""
    reply, seen = Reply(), []
    reply.fail(Unavailable("disk"))
    reply.then(lambda: seen.append("called"))
    assert seen == ["called"]
    with pytest.raises(Unavailable, match="disk"):
        reply.result()


async def test_a_kept_answer_comes_on_release() -> None:
    """`keep` holds the answer back (nothing awaits an event meanwhile) until `release`."""
    reply, seen = Reply(), []
    reply.then(lambda: seen.append(reply.result()))
    reply.keep({"count": 1})
    assert not reply.answered and seen == []
    assert reply.release() and seen == [{"count": 1}]
    assert not reply.release()  # nothing held any more
