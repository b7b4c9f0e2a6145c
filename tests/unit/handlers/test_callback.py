"""Signal driven directly: input validation against fn's annotation, sync and async fn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import msgspec
import pytest

from daemon.core.handler import ActiveHandler, CallbackRequest, Handler, TimedHandler
from daemon.errors import HandlerRejected
from handlers import Signal

REQ = CallbackRequest("wf", "main", "approve", 3)


@dataclass
class Approval:
    """A dataclass input."""

    user: str
    level: int
    tags: list[str] = field(default_factory=list)


class Order(TypedDict):
    """A TypedDict input."""

    sku: str
    qty: int
    note: NotRequired[str]


class Point(msgspec.Struct):
    """A msgspec Struct input."""

    x: float
    y: float = 0.0


class TestProtocol:
    async def test_passive(self) -> None:
        """Signal is a plain Handler: no listen, no deadline, empty setup data."""
        signal = Signal()
        assert isinstance(signal, Handler)
        assert not isinstance(signal, ActiveHandler | TimedHandler)
        assert signal.type == "signal"
        assert await signal.setup(REQ) == ""
        await signal.teardown(REQ, True)

    async def test_no_fn_replies_none(self) -> None:
        """Without fn the input is ignored and the reply is None."""
        assert await Signal().handle(REQ, {"anything": 1}) is None


class TestHandle:
    async def test_untyped_fn_gets_raw_input(self) -> None:
        """An unannotated fn receives the input as is and its return value is the reply."""
        seen: list[Any] = []

        def fn(x):  # type: ignore[no-untyped-def]
            seen.append(x)
            return "ok"

        assert await Signal(fn).handle(REQ, [1, 2]) == "ok"
        assert seen == [[1, 2]]

    async def test_async_fn_is_awaited(self) -> None:
        """A coroutine function is awaited."""

        async def fn(x: int) -> int:
            return x * 2

        assert await Signal(fn).handle(REQ, 21) == 42

    async def test_zero_argument_fn(self) -> None:
        """A fn with no parameter is called without the input."""
        assert await Signal(lambda: "done").handle(REQ, {"ignored": True}) == "done"

    async def test_bound_method(self) -> None:
        """A bound method (a workflow's own) works and sees its instance."""

        class Flow:
            approved_by = ""

            def approve(self, a: Approval) -> str:
                self.approved_by = a.user
                return f"approved by {a.user}"

        flow = Flow()
        reply = await Signal(flow.approve).handle(REQ, {"user": "ann", "level": 2})
        assert reply == "approved by ann"
        assert flow.approved_by == "ann"

    async def test_fn_error_propagates(self) -> None:
        """An exception from fn reaches the caller unchanged."""

        def fn(x: Any) -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            await Signal(fn).handle(REQ, 1)


class TestValidation:
    async def test_dataclass_converted(self) -> None:
        """A dict input becomes the annotated dataclass."""
        got: list[Approval] = []

        def fn(a: Approval) -> None:
            got.append(a)

        await Signal(fn).handle(REQ, {"user": "ann", "level": 2})
        assert got == [Approval("ann", 2)]

    async def test_dataclass_mismatch_lists_fields(self) -> None:
        """A mismatch is HandlerRejected naming the bad field and listing the expected ones."""

        def fn(a: Approval) -> None:
            raise AssertionError("fn must not run")

        with pytest.raises(HandlerRejected) as info:
            await Signal(fn).handle(REQ, {"user": "ann", "level": "high"})
        message = str(info.value)
        assert "$.level" in message
        assert "Approval {user: str, level: int, tags?: list[str]}" in message
        assert info.value.code == "bad_input"

    async def test_dataclass_missing_field(self) -> None:
        """A missing required field is named."""

        def fn(a: Approval) -> None:
            raise AssertionError("fn must not run")

        with pytest.raises(HandlerRejected, match="missing required field `level`"):
            await Signal(fn).handle(REQ, {"user": "ann"})

    async def test_typeddict(self) -> None:
        """A TypedDict annotation validates the input and lists its keys on mismatch."""
        got: list[Order] = []

        def fn(o: Order) -> int:
            got.append(o)
            return o["qty"]

        assert await Signal(fn).handle(REQ, {"sku": "a-1", "qty": 3}) == 3
        assert got == [{"sku": "a-1", "qty": 3}]
        with pytest.raises(HandlerRejected) as info:
            await Signal(fn).handle(REQ, {"sku": 7, "qty": 3})
        assert "$.sku" in str(info.value)
        assert "Order {sku: str, qty: int, note?: str}" in str(info.value)

    async def test_struct(self) -> None:
        """A msgspec Struct annotation is validated too."""

        async def fn(p: Point) -> float:
            return p.x + p.y

        assert await Signal(fn).handle(REQ, {"x": 1.5}) == 1.5
        with pytest.raises(HandlerRejected, match=r"Point \{x: float, y\?: float\}"):
            await Signal(fn).handle(REQ, {"y": 1})

    async def test_not_an_object(self) -> None:
        """A scalar input for a record type is rejected."""

        def fn(a: Approval) -> None:
            raise AssertionError("fn must not run")

        with pytest.raises(HandlerRejected, match="Expected `object`"):
            await Signal(fn).handle(REQ, "yes")

    async def test_plain_annotation_checked(self) -> None:
        """A plain annotation such as int is checked too, so bad data never reaches the workflow."""

        def fn(n: int) -> int:
            return n + 1

        assert await Signal(fn).handle(REQ, 41) == 42
        with pytest.raises(HandlerRejected, match="expected int"):
            await Signal(fn).handle(REQ, 1.5)
