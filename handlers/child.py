"""Child: a Wait case that starts a child workflow and fires when that child ends."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from daemon.core.children import get_children
from daemon.core.handler import CallbackRequest, Deliver
from daemon.core.state import MAIN_THREAD

#: What happens to a running child when its case is torn down (its parent ended or was
#: cancelled, or another case of the Wait won).
Policy = Literal["cancel", "abandon"]


class Child:
    """Starts `workflow` at setup; fires with `{workflow_id, status, result, error}` when it ends.

    The child's id defaults to `<parent id>/<case name>/<pc>` (`<parent id>/<case name>/
    <thread id>/<pc>` outside the main thread), so a setup that runs again (retried, or after
    a crash) finds the child it started rather than starting a second one.
    `result` is the child's `result()` if its class defines one, else its data. `fn(outcome)`,
    if given, runs when the case fires and may change the parent's data. With
    `on_parent_end="cancel"` (the default) a child still running when its case is torn down is
    cancelled, its own children with it; `"abandon"` leaves it running.
    """

    type = "child"

    def __init__(
        self,
        workflow: str,
        input: dict[str, Any] | None = None,
        id: str | None = None,
        fn: Callable[[dict[str, Any]], Any] | None = None,
        *,
        on_parent_end: Policy = "cancel",
    ) -> None:
        if on_parent_end not in ("cancel", "abandon"):
            raise ValueError(f"on_parent_end must be 'cancel' or 'abandon', not {on_parent_end!r}")
        if input is not None and not isinstance(input, dict):
            raise ValueError("Child(input=) must be a dict of the child's field values")
        self.workflow, self.input, self.id, self.fn = workflow, input, id, fn
        self.on_parent_end = on_parent_end

    def child_id(self, req: CallbackRequest) -> str:
        """Return the child's id: the one setup stored, else the one it would use."""
        if req.setup_data:
            try:
                return str(msgspec.json.decode(req.setup_data)["child"])
            except (msgspec.DecodeError, KeyError, TypeError):
                pass
        if self.id:
            return self.id
        if req.thread_id in ("", MAIN_THREAD):
            return f"{req.workflow_id}/{req.name}/{req.pc}"
        # Threads of one Go in a loop share their case names and may be at the same pc.
        return f"{req.workflow_id}/{req.name}/{req.thread_id}/{req.pc}"

    async def setup(self, req: CallbackRequest) -> str:
        """Start the child (an existing one is kept) and store its id."""
        cid = self.child_id(req)
        if cid == req.workflow_id:
            raise ValueError(f"Child id {cid!r} is the parent's own id")
        await get_children().start(
            parent=req.workflow_id, workflow=self.workflow, workflow_id=cid, input=self.input
        )
        return msgspec.json.encode({"child": cid, "workflow": self.workflow}).decode()

    async def listen(self, req: CallbackRequest, deliver: Deliver) -> None:
        """Wait for the child to end, then deliver its outcome."""
        await deliver(await get_children().outcome(self.child_id(req)))

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Call `fn(outcome)` if given; reply with the outcome."""
        if self.fn is not None:
            result = self.fn(input)
            if inspect.isawaitable(result):
                await result
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Cancel a child still running, unless the policy is to abandon it."""
        if not handled and self.on_parent_end == "cancel":
            await get_children().cancel(self.child_id(req))
