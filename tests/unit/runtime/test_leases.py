"""Tests for daemon.runtime.leases: the claim loop, drops, answers, against a fake shared store."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest

from daemon.errors import CallbackNotFound, Unavailable
from daemon.runtime import leases as leases_module
from daemon.runtime.leases import Leases, RemoteError
from daemon.runtime.work import Item
from daemon.store.base import Claimed, InboxRow, Taken, WorkflowRow


class FakeShared:
    """A shared store in memory: what it hands out, and what it was told."""

    node_id, holder = "a", "workflowd a 1 x"

    def __init__(self) -> None:
        self.free: list[WorkflowRow] = []
        self.inbox: list[Taken] = []
        self.owned: set[str] = set()
        self.lost: list[str] = []
        self.answered: list[tuple[int, str, bool, Any, bool]] = []
        self.stored: list[tuple[int, bool, Any]] = []
        self.requests: list[tuple[str, str, str, Any, bool]] = []
        self.wake: Callable[[str, str], None] | None = None

    def owns(self, workflow_id: str) -> bool:
        return workflow_id in self.owned

    def leads(self) -> bool:
        return True

    async def claim(self, limit: int) -> Claimed:
        rows, self.free = self.free[:limit], self.free[limit:]
        self.owned |= {r.id for r in rows}
        return Claimed(rows, [], [])

    async def renew(self) -> list[str]:
        lost, self.lost = self.lost, []
        self.owned -= set(lost)
        return lost

    def drop(self, workflow_id: str) -> None:
        self.owned.discard(workflow_id)

    async def take_inbox(self) -> list[Taken]:
        taken, self.inbox = self.inbox, []
        return taken

    async def request(
        self,
        workflow_id: str,
        kind: str,
        event: str,
        input: Any,
        *,
        thread_id: str = "",
        pc: int = 0,
        reply: bool = False,
    ) -> int:
        self.requests.append((workflow_id, kind, event, input, reply))
        return len(self.requests)

    async def answer(
        self, inbox_id: int, reply_to: str, ok: bool, value: Any, *, done: bool
    ) -> None:
        self.answered.append((inbox_id, reply_to, ok, value, done))

    async def answers(self) -> list[tuple[int, bool, Any]]:
        stored, self.stored = self.stored, []
        return stored

    async def owner_of(self, workflow_id: str) -> str | None:
        return "a" if workflow_id in self.owned else None

    async def pin(self, pin: Sequence[str], unpin: Sequence[str]) -> None:
        return None

    async def listen(self, wake: Callable[[str, str], None]) -> None:
        self.wake = wake
        await anyio.sleep_forever()


def row(wid: str) -> WorkflowRow:
    """Build a stored workflow row."""
    return WorkflowRow(id=wid, name="Demo", status="Resuming", data="{}", state="{}")


def taken(inbox_id: int, wid: str, kind: str = "callback", reply_to: str | None = "b") -> Taken:
    """Build an inbox row an owner took."""
    return Taken(InboxRow(inbox_id, wid, "go", "", 0, {"n": inbox_id}, 0.0), kind, reply_to)


class World:
    """A Leases over a FakeShared, and what it asked of the runtime."""

    def __init__(self, lease_s: float = 0.3) -> None:
        self.shared = FakeShared()
        self.recovered: list[tuple[str, bool]] = []
        self.items: list[tuple[str, Item]] = []
        self.lost: list[str] = []
        self.ended: list[str] = []

        async def recover(r: WorkflowRow, moved: bool) -> str:
            self.recovered.append((r.id, moved))
            return "resumed"

        self.leases = Leases(
            shared=self.shared,
            lease_s=lease_s,
            recover=recover,
            submit=lambda wid, item: self.items.append((wid, item)),
            lose=self.lost.append,
            ended=self.ended.append,
            waited=list,
            stopping=lambda: False,
            pinned=set,
        )


async def until(cond: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Wait for an in-process condition with a ceiling."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110 - plain objects of this process: nothing to await
            await anyio.sleep(0.005)


async def test_claims_in_batches_until_none_is_left() -> None:
    """Everything free is claimed before the start is reported, a batch at a time."""
    w = World()
    w.shared.free = [row(f"w{i}") for i in range(leases_module.CLAIM_BATCH * 2 + 3)]
    async with anyio.create_task_group() as tg:
        await tg.start(w.leases.run)
        assert len(w.recovered) == leases_module.CLAIM_BATCH * 2 + 3
        assert w.shared.free == []
        w.shared.free = [row("late")]
        await until(lambda: w.shared.wake is not None)
        assert w.shared.wake is not None
        w.shared.wake("workflowd_work", "")
        await until(lambda: ("late", False) in w.recovered)
        tg.cancel_scope.cancel()


async def test_lost_leases_are_dropped_and_endings_passed_on() -> None:
    """A renewal's lost workflows are dropped; a status notification wakes `wait`."""
    w = World()
    w.shared.free = [row("x")]
    async with anyio.create_task_group() as tg:
        await tg.start(w.leases.run)
        w.shared.lost = ["x"]
        await until(lambda: w.lost == ["x"])
        await until(lambda: w.shared.wake is not None)
        assert w.shared.wake is not None
        w.shared.wake("workflowd_status", "y")
        assert w.ended == ["y"]
        tg.cancel_scope.cancel()


async def test_taken_requests_are_queued_and_answered() -> None:
    """A taken callback is queued with its inbox id; its answer (or refusal) is stored for
    the sender; one not applied (Unavailable) is left for the next owner to answer."""
    w = World()
    w.shared.owned = {"w"}
    w.shared.inbox = [taken(1, "w"), taken(2, "w"), taken(3, "w"), taken(4, "w", "cancel")]
    async with anyio.create_task_group() as tg:
        await tg.start(w.leases.run)
        assert [(wid, i.kind, i.inbox_id) for wid, i in w.items] == [
            ("w", "callback", 1), ("w", "callback", 2), ("w", "callback", 3),
            ("w", "cancel", None),
        ]  # fmt: skip
        replies = [i.reply for _, i in w.items]
        assert all(r is not None for r in replies)
        replies[0].set(7)  # type: ignore[union-attr]
        replies[1].fail(CallbackNotFound("no such event"))  # type: ignore[union-attr]
        replies[2].fail(Unavailable("shutting down"))  # type: ignore[union-attr]
        replies[3].set({"status": "Cancelled"})  # type: ignore[union-attr]
        await until(lambda: len(w.shared.answered) == 3)
        assert sorted(w.shared.answered) == [
            (1, "b", True, 7, False),
            (2, "b", False, {"code": "not_found", "message": "no such event"}, False),
            (4, "b", True, {"status": "Cancelled"}, True),
        ]
        tg.cancel_scope.cancel()


async def test_a_send_through_a_non_owner_returns_the_owners_answer() -> None:
    """The request is stored for the owner; its answer (or its error, by code) comes back."""
    w = World()
    async with anyio.create_task_group() as tg:
        await tg.start(w.leases.run)
        assert await w.leases.send("w", "go", 1, thread_id="", pc=0, wait=False) == {"queued": True}
        w.shared.stored = [(2, True, 5)]
        w.shared.stored.append((3, False, {"code": "not_found", "message": "gone"}))

        async def send_and_fail() -> None:
            with pytest.raises(RemoteError) as caught:
                await w.leases.send("w", "go", 1, thread_id="", pc=0, wait=True)
            assert caught.value.code == "not_found" and str(caught.value) == "gone"

        # The answers came before their requests' ids were known here: they are kept.
        await until(lambda: w.shared.wake is not None)
        assert w.shared.wake is not None
        w.shared.wake("workflowd_reply", w.shared.holder)
        await until(lambda: w.shared.stored == [])
        assert await w.leases.send("w", "go", 1, thread_id="", pc=0, wait=True) == 5
        await send_and_fail()
        tg.cancel_scope.cancel()


async def test_no_answer_within_the_limit_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender whose owner never answers hears `unavailable`, saying the event is stored."""
    monkeypatch.setattr(leases_module, "ANSWER_MIN_S", 0.05)
    w = World(lease_s=0.01)
    async with anyio.create_task_group() as tg:
        await tg.start(w.leases.run)
        with pytest.raises(Unavailable, match="stored and will be applied"):
            await w.leases.send("w", "go", 1, thread_id="", pc=0, wait=True)
        tg.cancel_scope.cancel()
