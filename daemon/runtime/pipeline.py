"""One workflow's checkpoint writes in commit order: the next step runs while one commits."""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from daemon.runtime.work import Item

#: Checkpoints one queued write may stand for before the next one waits for a commit: with
#: the write in flight, at most twice this many steps run again after a crash.
AHEAD = 32
#: How long a checkpoint taken as a step starts is held back before its write is issued
#: (see Pipeline.queue): a quick step's checkpoint merges into it, one write instead of two.
HOLD_S = 0.002


@dataclass(slots=True, eq=False)
class Save:
    """A checkpoint's content, taken when it was asked for: what the store is to write."""

    status: str
    data: str
    state: str
    error: str | None
    attempt: int
    next_run_at: float | None
    history: list[tuple[str, dict[str, Any]]]
    #: The inbox events applied since the previous save (marked done by this one).
    items: list[Item] = field(default_factory=list)
    #: How many checkpoints this write stands for (later ones merge into a queued write).
    count: int = 1

    @property
    def inbox_done(self) -> list[int]:
        """Return the inbox rows this write drops."""
        return [item.inbox_id for item in self.items if item.inbox_id is not None]

    def merge(self, later: Save) -> None:
        """Take a later checkpoint into this one: its content, and its history after ours."""
        self.status, self.data, self.state = later.status, later.data, later.state
        self.error, self.attempt, self.next_run_at = later.error, later.attempt, later.next_run_at
        self.history += later.history
        self.items += later.items
        self.count += later.count


class _Holds:
    """The held writes (see Pipeline.queue) of every pipeline on one loop, under one timer.

    A timer per held write would put thousands in the loop's heap during a burst of fired
    timers (each push and pop a dozen Python-level comparisons); every hold is as long, so
    they end in the order they began, and one timer for the oldest serves them all. A hold
    that ends early (its write was wanted sooner: the common case, a quick step's workflow
    saving its end) is withdrawn; once none is left the timer is cancelled, so a burst of
    fired timers does not wake the loop and run three callbacks per fire for nothing.
    """

    __slots__ = ("_held", "_live", "_timer")

    def __init__(self) -> None:
        self._held: deque[tuple[float, Pipeline]] = deque()
        #: Holds added and neither over nor withdrawn; the entries of the others are stale.
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None

    def add(self, loop: asyncio.AbstractEventLoop, pipeline: Pipeline, seconds: float) -> None:
        """Issue `pipeline`'s held write `seconds` from now (if it is still held then)."""
        when = loop.time() + seconds
        self._held.append((when, pipeline))
        self._live += 1
        if self._timer is None:
            self._timer = loop.call_at(when, self._due, loop)

    def withdraw(self) -> None:
        """Note that one hold is no longer held (its write was issued or taken)."""
        self._live -= 1
        if not self._live:
            # Every entry left is stale: nothing for the timer to issue.
            self._held.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        held, now = self._held, loop.time()
        over: list[Pipeline] = []
        while held and held[0][0] <= now:
            pipeline = held.popleft()[1]
            if pipeline._held:  # else withdrawn since: its write is in flight or durable
                over.append(pipeline)
        if over:
            # Issued after the loop looked for I/O once more: a busy loop runs this timer late,
            # and the results of steps that ended meanwhile come in with that look. Their
            # actors then take their next turns before the writes' tasks take their first,
            # so each step's save still merges into its held write (one write, not two).
            loop.call_soon(loop.call_soon, _holds_over, over)
        if held:
            self._timer = loop.call_at(held[0][0], self._due, loop)


def _holds_over(over: list[Pipeline]) -> None:
    for pipeline in over:
        # One issued early (a flush) and held again since ends early: harmless.
        pipeline._hold_over()


#: One _Holds per running loop (tests run many loops, one after the other).
_HOLDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Holds] = weakref.WeakKeyDictionary()


class Pipeline:
    """Writes an actor's checkpoints one at a time, in the order they were taken.

    `put` queues a checkpoint and returns at once (a checkpoint taken while one is queued
    merges into it), so the workflow's next step runs while the previous one commits;
    `flush` waits until everything queued is durable. Whoever acknowledges anything (a reply,
    an end, a child's start, a command) flushes first. The first write that fails ends the
    pipeline: what was queued after it is dropped, `put` and `flush` raise that error, and
    the actor goes back to the durable state (`undurable` hands back its inbox events).
    """

    def __init__(
        self,
        write: Callable[[Save], Awaitable[None]],
        *,
        on_durable: Callable[[Save], None] = lambda save: None,
        ahead: int = AHEAD,
        hold_s: float = HOLD_S,
    ) -> None:
        self._write, self._on_durable, self._ahead = write, on_durable, ahead
        self._hold_s = hold_s
        self._queued: Save | None = None
        #: What is queued is held back (see `queue`): issued when its hold is over.
        self._held = False
        #: What is queued waits for the next checkpoint or commit to issue it (see `queue`).
        self._deferred = False
        #: The loop's holds this pipeline's hold is in (while `_held`).
        self._holds: _Holds | None = None
        # A bare task, not one of a task group's: it lives no longer than one write queue
        # drained, and every path out of the actor waits for it (`settle`). Written to from
        # outside the actor's cancel scopes, a commit under way is never cut off by a cancel.
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._lost: list[Save] = []
        #: Resolved when the queued write goes in flight (or the pipeline ends or fails).
        self._taken: asyncio.Future[None] | None = None
        #: One future per `flush` waiting, resolved when the write queue is drained. Each its
        #: own: a cancelled waiter cancels only its own, and no shield sits in between (two
        #: loop turns per flush saved).
        self._drained: list[asyncio.Future[None]] = []
        #: A write awaited by `commit` itself (no task): see `committing`.
        self._inline = False

    def room(self) -> int:
        """Return how many more checkpoints may queue before `put` waits for a commit."""
        return self._ahead - 1 - (self._queued.count if self._queued is not None else 0)

    @property
    def idle(self) -> bool:
        """Tell whether nothing is queued or being written."""
        return self._task is None and self._queued is None and not self._inline

    @property
    def clean(self) -> bool:
        """Tell whether nothing is queued, held, in flight, failed or lost (`settle` is moot)."""
        return (
            self._task is None
            and self._queued is None
            and not self._inline
            and self._error is None
            and not self._lost
        )

    @property
    def committing(self) -> bool:
        """Tell whether `commit` awaits a write in its caller's task: cancel that task later.

        A cancel would cut the caller off from the write's outcome (the write itself goes on
        in the store), so whoever cancels the task waits until this is False.
        """
        return self._inline

    async def put(self, save: Save) -> None:
        """Queue a checkpoint; wait only if the queued write already stands for `ahead` of them.

        Then it waits until that write goes in flight (the one before it is durable), so at
        most `ahead` checkpoints wait behind the write in flight.
        """
        if self.queue(save):
            await self.room_taken()

    def queue(self, save: Save, *, hold: bool = False, defer: bool = False) -> bool:
        """Queue a checkpoint as `put` does; True: the caller must `await room_taken()` next.

        A plain call: `put` without a coroutine of its own, for the actor's common case.
        `hold`: the checkpoint acknowledges nothing and a step runs next; with no write in
        flight, its write is issued HOLD_S later (or at the next `flush`, `settle`, or a
        checkpoint not held), so that a quick step's checkpoint, or the save after it,
        merges into it. A step that takes longer still runs while the write commits.
        `defer`: the caller takes the next checkpoint, or commits, before it awaits anything
        (a callback's save, then the resume it starts): that one issues this write, merged,
        with no timer and no task of its own. A held checkpoint issues it at once rather
        than holding it, since a deferred write may have a sender waiting for it.
        """
        if self._error is not None:
            raise self._error
        queued = self._queued
        if queued is None:
            self._queued = queued = save
        else:
            queued.merge(save)
        if self._task is None and not self._inline:
            if defer and queued.count < self._ahead:
                self._deferred = True
                return False
            if hold and queued.count < self._ahead and not self._deferred:
                if not self._held:
                    self._held = True
                    loop = asyncio.get_running_loop()
                    holds = _HOLDS.get(loop)
                    if holds is None:
                        holds = _HOLDS[loop] = _Holds()
                    holds.add(loop, self, self._hold_s)
                    self._holds = holds
                return False
            self._issue()
            return False
        return queued.count >= self._ahead

    def _hold_over(self) -> None:
        if self._held:
            self._issue()

    def _unhold(self) -> None:
        """End the hold of what is queued, if it is held (its write is issued or taken now)."""
        self._deferred = False
        if self._held:
            self._held = False
            holds, self._holds = self._holds, None
            if holds is not None:
                holds.withdraw()

    def _issue(self) -> None:
        """Start writing what is queued (a held write's time is over, or it is wanted now)."""
        self._unhold()
        if self._task is None and self._queued is not None and not self._inline:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def room_taken(self) -> None:
        """Wait until the queued write goes in flight (`put` of a checkpoint found it full)."""
        if self._taken is None:
            self._taken = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._taken)
        if self._error is not None:
            raise self._error

    async def flush(self) -> None:
        """Wait until every queued checkpoint is durable; raise the error of one that failed."""
        if self._held or self._deferred:
            self._issue()
        while self._task is not None:
            # Not the task itself: a cancelled caller stops waiting, the write goes on.
            drained = asyncio.get_running_loop().create_future()
            self._drained.append(drained)
            await drained
        if self._error is not None:
            raise self._error

    async def commit(self, save: Save) -> None:
        """Queue `save` and wait until it is durable, with every checkpoint before it.

        What `put` then `flush` do; with no write in flight (the common case: the save that
        settles a resume), the write is awaited right here, in the caller's task, instead of
        in a task of its own: no task, no wake-up of the caller by that task. The caller's
        task must not be cancelled while `committing` (only shutdown may, and it waits).
        """
        if self._error is not None:
            raise self._error
        if self._task is not None or self._inline:
            if self.queue(save):
                await self.room_taken()
            await self.flush()
            return
        self._unhold()
        queued, self._queued = self._queued, None
        if queued is not None:
            queued.merge(save)
            save = queued
        self._inline = True
        try:
            await self._write(save)
        except BaseException as e:
            self._inline = False
            self._error = e
            self._lost.append(save)
            if self._queued is not None:  # queued meanwhile: dropped, as `_drain` drops it
                self._lost.append(self._queued)
                self._queued = None
            raise
        self._inline = False
        self._on_durable(save)
        if self._queued is not None:
            self._issue()  # queued meanwhile: written after ours, in order

    async def settle(self) -> None:
        """Wait for the write in flight, whatever its outcome (before reading the store back).

        A write held back (see `queue`) is issued first: it is as good as in flight.
        """
        if self._held or self._deferred:
            self._issue()
        if self._task is None:
            return  # nothing in flight: no shielded scope to make (once per actor)
        with anyio.CancelScope(shield=True):
            while self._task is not None:
                await asyncio.wait([self._task])

    def undurable(self) -> list[Item]:
        """Forget a failure and return the inbox events of the writes it lost, in order."""
        lost = [*self._lost, *([self._queued] if self._queued is not None else [])]
        self._lost, self._queued, self._error = [], None, None
        self._unhold()
        return [item for save in lost for item in save.items]

    async def _drain(self) -> None:
        try:
            while self._queued is not None:
                save, self._queued = self._queued, None
                self._wake_taken()
                try:
                    await self._write(save)
                except BaseException as e:
                    self._error = e
                    self._lost.append(save)
                    if self._queued is not None:
                        self._lost.append(self._queued)
                        self._queued = None
                    if not isinstance(e, Exception):
                        raise
                    return
                self._on_durable(save)
        finally:
            self._task = None
            self._wake_taken()
            drained, self._drained = self._drained, []
            for waiter in drained:
                if not waiter.done():
                    waiter.set_result(None)

    def _wake_taken(self) -> None:
        if self._taken is not None:
            if not self._taken.done():
                self._taken.set_result(None)
            self._taken = None
