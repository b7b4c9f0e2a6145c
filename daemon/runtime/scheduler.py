"""One actor per workflow with work queued; holds, and the exclusive access repairs need."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import structlog

from daemon.core.state import WorkflowStatus
from daemon.errors import Conflict
from daemon.runtime.actor import Actor
from daemon.runtime.cache import Cache, Loaded
from daemon.runtime.work import Item

log = structlog.get_logger()

#: How often, at shutdown, an actor still running is cancelled again.
RECANCEL_S = 0.05
#: How long `exclusive` waits for a workflow that is taking a callback to block again.
BUSY_WAIT_S = 5.0


class Hold:
    """Which workflows may not run now; work queued for them is parked until they may."""

    def __init__(self, held: bool) -> None:
        #: Set by `workflowd --hold` until `resume-all`.
        self.held = held
        self.released: set[str] = set()
        #: Workflows a repair holds off (`Scheduler.exclusive`).
        self.busy: set[str] = set()
        #: Workflows whose stored state does not fit the running code, with the reason; held
        #: until a reload, a restart or a repair makes them fit.
        self.incompatible: dict[str, str] = {}
        self.parked: dict[str, list[Item]] = {}

    def holds(self, workflow_id: str) -> bool:
        """Tell whether the workflow is held (`workflowd --hold` and not released, or unfit)."""
        if workflow_id in self.incompatible:
            return True
        return self.held and workflow_id not in self.released

    def park(self, workflow_id: str, item: Item) -> bool:
        """Keep `item` for later if its workflow may not run now; a cancel passes a hold."""
        if workflow_id in self.busy or (self.holds(workflow_id) and item.kind != "cancel"):
            self.parked.setdefault(workflow_id, []).append(item)
            return True
        return False


class Scheduler:
    """Starts an actor for a workflow when work arrives for it; the actor exits once it blocks.

    Each actor runs as a plain asyncio task (an anyio task group's spawn costs several times
    more, and a burst of fired timers starts thousands a second). They belong to `run`, which
    the runtime's task group holds: when it is cancelled it cancels every actor and waits for
    them, and an actor that raises ends it with that error, as a task group's child would.
    """

    def __init__(
        self,
        *,
        cache: Cache,
        hold: Hold,
        new_actor: Callable[[str], Actor],
    ) -> None:
        self._cache, self.hold, self._new_actor = cache, hold, new_actor
        self._actors: dict[str, Actor] = {}
        #: The actors' tasks, by workflow id.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Set to the first error an actor raised; `run` re-raises it.
        self._failed: asyncio.Future[None] | None = None
        #: Set once shutdown began: no new work is taken.
        self.stopping = False
        # asyncio's, not anyio's: one is made whenever work arrives after a quiet moment, and
        # anyio looks its backend up for every Event it makes.
        self._idle = asyncio.Event()
        self._idle.set()
        #: Told each workflow whose actor exited, with its status then: schedules wait on it.
        self.on_exit: Callable[[str, str | None], None] | None = None

    async def run(self) -> None:
        """Host the actors' tasks until cancelled; then cancel them and wait until they end."""
        self._failed = asyncio.get_running_loop().create_future()
        try:
            await self._failed
        finally:
            with anyio.CancelScope(shield=True):
                while self._tasks:
                    for wid, task in self._tasks.items():
                        # One awaiting its own write is cancelled once the write is in: a
                        # cancel now would cut it off from the write's outcome.
                        if not self._actors[wid].committing:
                            task.cancel()
                    # Cancelled again until it ends, as a cancel scope would: an actor that
                    # awaits in a `finally` is told again (a cancel scope of its own each
                    # would cost every actor more than its task does).
                    await asyncio.wait(list(self._tasks.values()), timeout=RECANCEL_S)
                    # One cancelled before its first turn never ran `_run`, nor its cleanup.
                    for wid in [wid for wid, task in self._tasks.items() if task.done()]:
                        self._forget(wid)

    def submit(self, workflow_id: str, item: Item) -> None:
        """Queue work for a workflow, starting its actor if it has none."""
        hold = self.hold
        # Nothing held (the common case): no call to find that out.
        if (hold.busy or hold.held or hold.incompatible) and hold.park(workflow_id, item):
            return
        actor = self._actors.get(workflow_id)
        if actor is None:
            actor = self._actors[workflow_id] = self._new_actor(workflow_id)
            if self._idle.is_set():
                # Only a set event is replaced: one still awaited must be the one set later
                # (an actor starting another's actor, as a Child's setup does).
                self._idle = asyncio.Event()
            # No done callback: `_run` itself forgets its task and reports its error.
            self._tasks[workflow_id] = asyncio.get_running_loop().create_task(self._run(actor))
        actor.items.append(item)
        actor.notify()

    def _crashed(self, workflow_id: str, error: Exception) -> None:
        """End `run` with an actor's error, as a task group's child would end its group."""
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(error)
        else:  # no host to end (or it ends already): said, not lost
            log.error(
                "actor_crashed", workflow_id=workflow_id, error=f"{type(error).__name__}: {error}"
            )

    def unpark(self, workflow_id: str) -> None:
        """Submit the work parked for a workflow."""
        for item in self.hold.parked.pop(workflow_id, []):
            self.submit(workflow_id, item)

    def park_queued(self, workflow_id: str) -> None:
        """Park what is queued for a workflow just found held (a cancel stays: it passes)."""
        actor = self._actors.get(workflow_id)
        if actor is None:
            return
        kept = [item for item in actor.items if item.kind == "cancel"]
        self.hold.parked.setdefault(workflow_id, []).extend(
            item for item in actor.items if item.kind != "cancel"
        )
        actor.items.clear()
        actor.items.extend(kept)

    async def _run(self, actor: Actor) -> None:
        wid = actor.workflow_id
        try:
            try:
                await actor.run()
            finally:
                self._forget(wid)
        except Exception as error:  # noqa: BLE001 - handed to `run`, which re-raises it
            self._crashed(wid, error)

    def _forget(self, workflow_id: str) -> None:
        """Drop an ended actor and its task, and say that it exited."""
        # Both before anything below may submit: a new actor for it gets a new task.
        actor = self._actors.pop(workflow_id)
        del self._tasks[workflow_id]
        actor.exited()
        if self.on_exit is not None:
            loaded = self._cache.get(workflow_id)
            self.on_exit(workflow_id, loaded.state.status.value if loaded else None)
        if not self._actors:
            self._idle.set()

    def running(self, workflow_id: str) -> bool:
        """Tell whether the workflow has an actor now."""
        return workflow_id in self._actors

    def actor(self, workflow_id: str) -> Actor | None:
        """Return the workflow's actor, if it has one."""
        return self._actors.get(workflow_id)

    def __len__(self) -> int:
        return len(self._actors)

    def busy(self) -> int:
        """Count the workflows with a step, callback or resume in flight (not a retry backoff)."""
        return sum(1 for actor in self._actors.values() if actor.busy)

    async def wait_idle(self) -> None:
        """Return once no workflow has work in progress (used by tests and shutdown)."""
        while self._actors:
            await self._idle.wait()

    async def drain(self, grace_s: float) -> bool:
        """Stop taking work and wait up to `grace_s` for running steps; True if all finished."""
        self.stopping = True
        for actor in list(self._actors.values()):
            actor.stop_after_current()
        with anyio.move_on_after(grace_s):
            await self.wait_idle()
            return True
        return False

    @asynccontextmanager
    async def exclusive(self, workflow_id: str) -> AsyncIterator[Loaded]:
        """Keep the workflow's actor and callbacks off it; yield it fresh from the store."""
        hold = self.hold
        if workflow_id in hold.busy:
            raise Conflict(f"workflow {workflow_id} is being changed by another request")
        hold.busy.add(workflow_id)
        try:
            actor = self._actors.get(workflow_id)
            if actor is not None:
                # A workflow taking a callback blocks again soon; one running steps may not.
                c = self._cache.get(workflow_id)
                if c and c.state.status is not WorkflowStatus.RESUMING and c.next_run_at is None:
                    with anyio.move_on_after(BUSY_WAIT_S):
                        await actor.wait_done()
                if workflow_id in self._actors:
                    raise Conflict(
                        f"workflow {workflow_id} is running; wait until it waits or fails"
                    )
            yield await self._cache.reload(workflow_id)
        finally:
            hold.busy.discard(workflow_id)
            self.unpark(workflow_id)
