"""Tests for handlers.child: ids, the outcome's delivery, fn, and the parent-close policy."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.core.children import use_children
from daemon.core.handler import CallbackRequest
from daemon.errors import Unavailable
from handlers import Child


class FakeChildren:
    """Records what a Child asks of the runtime."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str, str, dict[str, Any] | None]] = []
        self.cancelled: list[str] = []

    async def start(
        self, *, parent: str, workflow: str, workflow_id: str, input: dict[str, Any] | None
    ) -> None:
        self.started.append((parent, workflow, workflow_id, input))

    async def outcome(self, workflow_id: str) -> dict[str, Any]:
        return {"workflow_id": workflow_id, "status": "Finished", "result": 1, "error": None}

    async def cancel(self, workflow_id: str) -> None:
        self.cancelled.append(workflow_id)


class TestChild:
    async def test_default_ids_and_setup_data(self) -> None:
        """The id is `<parent>/<case>/<pc>`, with the thread id outside the main thread."""
        fake = FakeChildren()
        use_children(fake)
        kid = Child("Build", input={"rev": "abc"})
        data = await kid.setup(CallbackRequest("p", "_main_", "built", 3))
        await kid.setup(CallbackRequest("p", "fan:2", "built", 3))
        assert [s[2] for s in fake.started] == ["p/built/3", "p/built/fan:2/3"]
        assert fake.started[0] == ("p", "Build", "p/built/3", {"rev": "abc"})
        # Later calls use the id setup stored, whatever the code computes now.
        assert Child("Build", id="other").child_id(CallbackRequest(setup_data=data)) == "p/built/3"

    async def test_outcome_is_delivered_and_fn_called(self) -> None:
        """listen delivers the outcome; handle calls fn with it and replies with it."""
        use_children(FakeChildren())
        seen: list[dict[str, Any]] = []
        kid = Child("Build", fn=seen.append)
        delivered: list[Any] = []

        async def deliver(value: Any) -> Any:
            delivered.append(value)
            return await kid.handle(CallbackRequest(), value)

        await kid.listen(CallbackRequest("p", "_main_", "built", 1), deliver)
        assert delivered[0]["workflow_id"] == "p/built/1" and seen == delivered

    async def test_teardown_follows_the_policy(self) -> None:
        """A child whose case did not fire is cancelled, unless abandoned."""
        fake = FakeChildren()
        use_children(fake)
        req = CallbackRequest("p", "_main_", "built", 1)
        await Child("Build").teardown(req, handled=False)
        await Child("Build").teardown(req, handled=True)
        await Child("Build", on_parent_end="abandon").teardown(req, handled=False)
        assert fake.cancelled == ["p/built/1"]

    def test_bad_arguments(self) -> None:
        """A policy other than cancel/abandon, or an input that is not a dict, is refused."""
        with pytest.raises(ValueError, match="on_parent_end"):
            Child("Build", on_parent_end="orphan")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="dict"):
            Child("Build", input=[1])  # type: ignore[arg-type]

    async def test_without_a_runtime(self) -> None:
        """Outside a daemon, setup fails with a clear error (recorded as a setup error)."""
        with pytest.raises(Unavailable, match="running workflowd"):
            await Child("Build").setup(CallbackRequest("p", "_main_", "built", 1))
