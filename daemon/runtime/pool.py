"""One workflow's steps in flight: one per thread, at the same time, each retried on its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import structlog

from daemon.clock import Clock
from daemon.core.command import Run
from daemon.core.engine import Done, Start
from daemon.core.merge import Fork
from daemon.core.statements import NonRetryableError, Retry, Step
from daemon.errors import StepFailed
from daemon.runtime.settings import Settings
from daemon.runtime.steps import (
    CHAIN_S,
    Chain,
    Note,
    StepRun,
    chain_kind,
    run_chain,
    run_step,
)

log = structlog.get_logger()
#: Records a retry that is due: its history entry, attempt, error and when it runs again.
OnRetry = Callable[[dict[str, Any], int, str, float], Awaitable[None]]
#: Told each attempt's end: the step, "done", "failed" or "cancelled", and its seconds.
Observe = Callable[[str, str, float], None]


class StepPool:
    """Runs the engine's steps (daemon.core.engine.Steps) as tasks of its own task group.

    A failing step is retried with backoff in its own task, against a fresh fork, while the
    other threads' steps go on; one that fails for good is handed to the engine, which fails
    the workflow, and leaving the pool cancels the rest (sync steps are abandoned). A step
    alone in flight may run the thread's next quick steps with it, as a chain (see Chain and
    Start.then), when the pool is given `room`. Use it as
    `async with StepPool(...) as pool: await resume(..., steps=pool)`; entering it does
    nothing, and leaving it matters only when `grouped` (the actor skips both otherwise).
    """

    def __init__(
        self,
        *,
        limiter: anyio.CapacityLimiter,
        clock: Clock,
        settings: Settings,
        note: Note,
        on_retry: OnRetry,
        attempts: dict[str, int] | None = None,
        observe: Observe | None = None,
        durable: Callable[[], Awaitable[None]] | None = None,
        room: Callable[[], int] | None = None,
        save: Callable[[], Awaitable[None]] | None = None,
        chain_s: float = CHAIN_S,
    ) -> None:
        self._limiter, self._clock, self._settings = limiter, clock, settings
        #: How many more checkpoints the workflow's pipeline may take before one waits for a
        #: commit: a lone thread's steps run as a chain (see Chain), at most that many after
        #: the first. None: each step is handed back to the engine on its own.
        self._room = room
        #: Puts a checkpoint of the workflow as it is now (after a chain's failed step).
        self._save = save
        self._chain_s = chain_s
        #: Steps run in chains since `take_chained` was last called (their checkpoints are
        #: taken together, with the next one).
        self._chained = 0
        #: A chain was given up on (a cancel) after it had moved the workflow's state on in
        #: its thread: the state in memory is no longer one the engine saw; read it back.
        self.stale = False
        self._observe = observe
        #: Returns once the workflow's checkpoints so far are durable (see `stepping`).
        self._durable = durable
        self._note, self._on_retry = note, on_retry
        #: Failed attempts already made, by thread (from before a restart).
        self._failed_before = attempts or {}
        #: The steps running now, by thread id, for `show`.
        self.running: dict[str, StepRun] = {}
        self._backing_off: dict[str, anyio.CancelScope] = {}
        #: The chains running now (told to stop going on by `stop`).
        self._chains: set[Chain] = set()
        #: Steps started but not yet running: the engine waits for one in `next`.
        self._pending: list[tuple[str, Callable[..., Fork]]] = []
        self._done: list[Done] = []
        self._error: BaseException | None = None
        # asyncio's event, not anyio's: one is made per wait, and anyio's costs a lookup. Made
        # when first waited for: most resumes run no step, or one alone, and never wait.
        self._wake: asyncio.Event | None = None
        #: Steps between their first attempt and their end (retry waits included).
        self._flight = 0
        self._stopping = False
        self._tg: anyio.abc.TaskGroup | None = None
        #: Step tasks started in the group and not yet ended.
        self._tasks = 0

    async def __aenter__(self) -> Self:
        # The task group is entered when a step first needs a task of its own (`next`): most
        # resumes run no step, or one alone, and an empty group still costs a loop turn on
        # leaving it (anyio checkpoints there), once per callback.
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._tg is None:
            return None
        # Steps still in flight when the engine is done (a step failed for good, the workflow
        # finished or was cancelled) are not wanted any more. With no task started there is
        # nothing to stop, and a cancel costs a callback's advance ~15 µs (anyio names the
        # cancelling task in its reason, a Task repr).
        if self._tasks:
            self._tg.cancel_scope.cancel()
        # Told nothing of `exc`, the group only waits for its tasks: it would wrap `exc` in an
        # ExceptionGroup, and the engine's StepFailed must reach the actor as it is.
        await self._tg.__aexit__(None, None, None)
        return None

    @property
    def grouped(self) -> bool:
        """Tell whether steps ran in tasks of their own: leaving the pool then waits for them."""
        return self._tg is not None

    @property
    def resting(self) -> bool:
        """Tell whether every step in flight waits for its retry (none runs)."""
        return self._flight > 0 and not self.running and len(self._backing_off) == self._flight

    @property
    def stepping(self) -> bool:
        """Tell whether steps are about to run or running (their checkpoints may pipeline)."""
        return bool(self._pending) or self._flight > 0

    def take_chained(self) -> int:
        """Return how many steps chains ran after their first since the last call, and reset."""
        n, self._chained = self._chained, 0
        return n

    def stop(self) -> None:
        """Start no more steps, and end the retry waits (shutdown); running steps go on."""
        self._stopping = True
        for chain in self._chains:
            chain.stopped = True
        for scope in self._backing_off.values():
            scope.cancel()

    def start(self, thread_id: str, make_fork: Callable[..., Fork]) -> None:
        """Take a thread's step to run (or, when stopping, report it not run)."""
        if self._stopping:
            self._report(Done(thread_id))
        else:
            self._pending.append((thread_id, make_fork))

    async def next(self) -> list[Done]:
        """Wait until some step has ended; return every one that has, in the order they did.

        A step that is the only one in flight runs right here, on the live data: nothing can
        overlap it, and a task and a copy per step would only cost time.
        """
        if self._stopping:  # stopped while the engine was checkpointing: run none of them
            for thread_id, _ in self._pending:
                self._report(Done(thread_id))
            self._pending.clear()
        if self._pending and not self._done:
            if len(self._pending) == 1 and self._flight == 0:
                thread_id, make_fork = self._pending.pop()
                self._flight = 1
                try:
                    lone = [await self._attempts(thread_id, make_fork, True)]
                finally:
                    self._flight = 0
                if self._durable is not None and _unrun(lone):
                    await self._durable()
                return lone
            if self._tg is None:
                self._tg = anyio.create_task_group()
                await self._tg.__aenter__()
            for thread_id, make_fork in self._pending:
                self._tasks += 1
                self._tg.start_soon(self._run, thread_id, make_fork)
            self._pending.clear()
        while not self._done and self._error is None:
            if self._wake is None:
                self._wake = asyncio.Event()
            self._wake.clear()
            await self._wake.wait()
        if self._error is not None:
            raise self._error
        done, self._done = self._done, []
        if self._durable is not None and _unrun(done):
            await self._durable()
        return done

    def _report(self, done: Done) -> None:
        self._done.append(done)
        if self._wake is not None:
            self._wake.set()

    async def _run(self, thread_id: str, make_fork: Callable[..., Fork]) -> None:
        try:
            self._report(await self._attempts_of(thread_id, make_fork))
        except Exception as e:  # noqa: BLE001 - e.g. the retry not stored: the engine raises it
            self._error = e
            if self._wake is not None:
                self._wake.set()
        finally:
            self._tasks -= 1

    def _chain_room(self, step: Step, make_fork: Callable[..., Fork], alone: bool) -> int | None:
        """Return how many steps may follow `step` in a chain; None: it runs on its own."""
        if self._room is None or not alone or not isinstance(make_fork, Start):
            return None
        if chain_kind(step) is None:
            return None
        return max(0, self._room())

    async def _attempts_of(
        self, thread_id: str, make_fork: Callable[..., Fork], *, alone: bool = False
    ) -> Done:
        self._flight += 1
        try:
            return await self._attempts(thread_id, make_fork, alone)
        finally:
            self._flight -= 1

    async def _attempts(self, thread_id: str, make_fork: Callable[..., Fork], alone: bool) -> Done:
        attempt = self._failed_before.pop(thread_id, 0)
        while True:
            # A fresh fork each attempt: other threads' changes may have landed meanwhile.
            f = make_fork(alone=alone)
            step = f.step
            self.running[thread_id] = run = StepRun(step.name)
            outcome = "cancelled"

            def note(kind: str, detail: dict[str, Any]) -> None:
                self._note(kind, {**detail, "thread": thread_id})

            chain: Chain | None = None
            try:
                if isinstance(step, Run) and self._durable is not None:
                    await self._durable()  # a command is seen outside: what led to it is saved
                room = self._chain_room(step, make_fork, alone)
                if room is None:
                    await run_step(step, limiter=self._limiter, note=note, run=run, data=f.copy)
                else:
                    assert isinstance(make_fork, Start)
                    chain = Chain(
                        make_fork, f, room, stopped=self._stopping, budget_s=self._chain_s
                    )
                    self._chains.add(chain)
                    try:
                        await run_chain(
                            chain,
                            limiter=self._limiter,
                            note=note,
                            running=self.running,
                            thread_id=thread_id,
                            observe=self._observe,
                            noted=self._note,
                        )
                    finally:
                        self._chains.discard(chain)
                        self.stale = self.stale or chain.stale
                        # Whatever ran last is this attempt's step: a retry runs that one.
                        make_fork, f, step = chain.start, chain.fork, chain.fork.step
                        run = self.running[thread_id]
                        if chain.stepped:
                            attempt = 0
                            self._chained += chain.stepped - chain.moved
                    if chain.moved:
                        outcome = "done"
                        return Done(thread_id, moved=True)
                f.finish()
                outcome = "done"
                return Done(thread_id, f)
            except Exception as e:  # noqa: BLE001 - a step may raise anything: retried or failed
                outcome = "failed"
                f.discard()
                failure = StepFailed(step.name, e)
            finally:
                del self.running[thread_id]
                if self._observe is not None:
                    self._observe(step.name, outcome, time.monotonic() - run.began)
            if chain is not None and chain.stepped and self._save is not None:
                # The chain's earlier steps are checkpointed (as they would have been one by
                # one) before the failure is stored or fails the workflow.
                self._chained -= 1
                await self._save()
            attempt += 1
            policy = step.retry or Retry()
            limit = policy.max_attempts
            if limit is None:
                limit = self._settings.retry_max_attempts
            detail: dict[str, Any] = {
                "step": step.name,
                "error": str(failure),
                "attempt": attempt,
                "thread": thread_id,
            }
            if isinstance(failure.cause, (NonRetryableError, *policy.non_retryable)) or (
                limit and attempt >= limit
            ):
                log.warning("step_failed", **detail, final=True)
                self._note("step_failed", detail)
                return Done(thread_id, failure=failure)
            delay = self._settings.backoff(attempt, policy.initial_s, policy.max_s)
            log.warning("step_failed", **detail, retry_in_s=delay)
            due = self._clock.now() + delay
            await self._on_retry({**detail, "retry_in_s": delay}, attempt, str(failure), due)
            if self._stopping:
                return Done(thread_id)
            with anyio.CancelScope() as scope:
                self._backing_off[thread_id] = scope
                try:
                    await self._clock.sleep_until(due)
                finally:
                    del self._backing_off[thread_id]
            if scope.cancelled_caught:
                return Done(thread_id)  # stopping: it runs again after the restart


def _unrun(done: list[Done]) -> bool:
    """Tell whether a step in `done` was not run, so what ran before must be durable first.

    A step not run (stopping) lets the engine set up waits next, which tell the outside.
    """
    # A loop, not any() over a generator: this runs once per step.
    for d in done:  # noqa: SIM110
        if d.fork is None and d.failure is None and not d.moved:
            return True
    return False
