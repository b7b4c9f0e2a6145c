"""Failure and finish hooks: a program run once per ending of a workflow, never through a shell."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc
import structlog

from daemon.errors import WorkflowdError

log = structlog.get_logger()
#: The placeholders an argv template may use; each is also in the environment, upper-cased
#: with a `WORKFLOWD_` prefix (`WORKFLOWD_WORKFLOW_ID`).
FIELDS = ("workflow", "workflow_id", "status", "error", "event")
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
#: Output kept from a hook (stdout and stderr together) for the log.
OUTPUT_KEPT = 2000
#: Hooks running at once; the rest wait their turn (the daemon never waits for them).
MAX_RUNNING = 4
#: Endings read from the queue at a time.
PAGE = 100
RETRY_MAX_S = 60.0
#: How long endings are gathered before the queue is read while no ending has a hook to run:
#: each then costs its share of one read and one delete, not a read and a delete of its own.
GATHER_S = 0.25


@dataclass(slots=True)
class HookRow:
    """One ending of a workflow (Failed or Finished) whose hooks are still to run."""

    #: The ending's key: a workflow that fails again after a retry gets a new one.
    id: int
    workflow_id: str
    workflow: str
    status: str
    error: str | None
    at: float
    #: When its hook was started; a row with this set is never run again.
    started_at: float | None = None


class HookQueue(Protocol):
    """The durable queue of workflow endings the hook runner works through (the store)."""

    async def hooks_pending(self, *, after: int = 0, limit: int = 100) -> builtins.list[HookRow]:
        """Return up to `limit` endings with an id over `after`, oldest first."""
        ...

    async def hook_claim(self, hook_id: int) -> None:
        """Mark an ending's hook as started, durably, before it runs."""
        ...

    async def hooks_done(self, hook_ids: Sequence[int]) -> None:
        """Forget endings whose hooks ran (or that have none)."""
        ...

    async def add_history(self, workflow_id: str, kind: str, detail: dict[str, Any]) -> None:
        """Append one history entry to a workflow."""
        ...


@dataclass(frozen=True, slots=True)
class HookSettings:
    """The `[hooks]` section: global argv templates and the timeout."""

    on_failure: tuple[str, ...] = ()
    on_finish: tuple[str, ...] = ()
    timeout_s: float = 30.0


#: The argv template a workflow type sets for "Failed" or "Finished", or None for the global.
TypeHook = Callable[[str, str], Sequence[str] | None]


def check_template(argv: Sequence[str]) -> None:
    """Raise ValueError for a placeholder that is not one of FIELDS."""
    for a in argv:
        for m in _PLACEHOLDER.finditer(a):
            if m.group(1) is not None and m.group(1) not in FIELDS:
                raise ValueError(
                    f"unknown placeholder {{{m.group(1)}}} in {a!r}; use {', '.join(FIELDS)}"
                )


def fill(argv: Sequence[str], values: dict[str, str]) -> list[str]:
    """Put the values into an argv template; `{{` and `}}` stand for braces."""
    check_template(argv)

    def one(m: re.Match[str]) -> str:
        if m.group(1) is None:
            return m.group(0)[0]
        return values[m.group(1)]

    return [_PLACEHOLDER.sub(one, a) for a in argv]


class Hooks:
    """Runs the hooks of every workflow ending, each once, as the store's queue lists them.

    The queue row is written in the transaction that ends the workflow. Before a hook starts,
    its row is marked started (durably), and it is deleted once the hook is done: so a crash
    before the start runs it after the restart, and a crash after never runs it twice (it is
    logged as `hook_interrupted` instead). A claim that fails leaves the row for the next
    start; the hook is not run without it.
    """

    def __init__(
        self,
        *,
        queue: HookQueue,
        settings: Callable[[], HookSettings],
        of_type: TypeHook,
        max_running: int = MAX_RUNNING,
    ) -> None:
        self._queue, self._settings, self._of_type = queue, settings, of_type
        self._slots = anyio.Semaphore(max_running)
        # asyncio's event, not anyio's: it is set at every ending, and made after every drain.
        self._wake = asyncio.Event()
        self._after = 0
        #: The last drain found endings and none had a hook: the next one gathers first.
        self._gather = False

    def wake(self) -> None:
        """Say that a workflow ended: the queue has a new row."""
        self._wake.set()

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Work through the queue whenever woken; hooks run as tasks of `tg`. Never raises."""
        failures = 0
        while True:
            self._wake = asyncio.Event()  # before reading: a wake meanwhile is not lost
            try:
                await self.drain(tg)
            except Exception as e:  # noqa: BLE001 - e.g. the store is locked: retry with backoff
                failures += 1
                delay = min(RETRY_MAX_S, 0.5 * 2**failures)
                error = f"{type(e).__name__}: {e}"
                log.error("task_failed", task="hooks", error=error, retry_in_s=delay)
                await anyio.sleep(delay)
                continue
            if failures:
                log.info("task_recovered", task="hooks", failures=failures)
                failures = 0
            await self._wake.wait()
            if self._gather:
                # Nothing to run lately (no hook configured for what ended): the endings of
                # the next moment are read and forgotten together. Once one has a hook, each
                # ending is read as it comes again.
                await anyio.sleep(GATHER_S)

    async def drain(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the hooks of every queued ending not yet seen."""
        seen = ran = False
        while rows := await self._queue.hooks_pending(after=self._after, limit=PAGE):
            settings = self._settings()
            nothing: list[int] = []
            seen = True
            for row in rows:
                self._after = row.id
                if row.started_at is not None:
                    log.warning(
                        "hook_interrupted",
                        workflow_id=row.workflow_id,
                        workflow=row.workflow,
                        status=row.status,
                        note="the daemon stopped while it ran; it is not run again",
                    )
                    nothing.append(row.id)
                    continue
                argv = self._argv(row, settings)
                if not argv:
                    nothing.append(row.id)
                    continue
                ran = True
                # A slot first: the queue, not a crowd of waiting tasks, holds the backlog.
                await self._slots.acquire()
                tg.start_soon(self._run_one, row, argv, settings.timeout_s)
            if nothing:
                await self._queue.hooks_done(nothing)
        if seen:
            self._gather = not ran

    def _argv(self, row: HookRow, settings: HookSettings) -> Sequence[str]:
        own = self._of_type(row.workflow, row.status)
        if own is not None:
            return own
        return settings.on_failure if row.status == "Failed" else settings.on_finish

    async def _run_one(self, row: HookRow, template: Sequence[str], timeout_s: float) -> None:
        event = "failure" if row.status == "Failed" else "finish"
        values = {
            "workflow": row.workflow,
            "workflow_id": row.workflow_id,
            "status": row.status,
            "error": row.error or "",
            "event": event,
        }
        about = {"workflow_id": row.workflow_id, "workflow": row.workflow, "hook": event}
        try:
            # Claimed only once it has a slot: one still waiting when the daemon dies runs
            # after the restart.
            try:
                await self._queue.hook_claim(row.id)
            except Exception as e:  # noqa: BLE001 - never crash: the row waits for the next start
                log.warning("hook_not_started", **about, error=f"{type(e).__name__}: {e}")
                return
            try:
                outcome = await _spawn(fill(template, values), values, timeout_s)
            except Exception as e:  # noqa: BLE001 - not found, not executable, a bad template
                outcome = {"error": f"{type(e).__name__}: {e}"}
        finally:
            self._slots.release()
        ok = outcome.get("exit_code") == 0
        if ok:
            log.info("hook_ran", **about, **outcome)
        else:
            log.warning("hook_failed", **about, **outcome)
        kind = "hook_ran" if ok else "hook_failed"
        try:
            await self._queue.add_history(row.workflow_id, kind, {"hook": event, **outcome})
        except WorkflowdError:
            pass  # deleted meanwhile (retention): the log keeps what happened
        except Exception as e:  # noqa: BLE001 - the hook ran; only its record is lost
            log.warning("hook_not_recorded", **about, error=f"{type(e).__name__}: {e}")
        try:
            await self._queue.hooks_done([row.id])
        except Exception as e:  # noqa: BLE001 - left marked started: never run again
            log.warning("hook_not_recorded", **about, error=f"{type(e).__name__}: {e}")


async def _spawn(argv: list[str], values: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run one hook program to its end or its timeout; return its outcome for log and history."""
    env = {**os.environ, **{f"WORKFLOWD_{k.upper()}": v for k, v in values.items()}}
    began = time.monotonic()
    async with await anyio.open_process(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: a timeout kills its children too
    ) as proc:
        output = bytearray()

        async def read() -> None:
            assert proc.stdout is not None
            async for chunk in proc.stdout:
                if len(output) < OUTPUT_KEPT:
                    output.extend(chunk[: OUTPUT_KEPT - len(output)])

        timed_out = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            with anyio.move_on_after(timeout_s) as scope:
                await proc.wait()
            if scope.cancelled_caught:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            tg.cancel_scope.cancel()  # a grandchild may hold the pipe open
    out: dict[str, Any] = {
        "argv0": argv[0],
        "exit_code": proc.returncode,
        "duration_s": round(time.monotonic() - began, 3),
    }
    if timed_out:
        out.update(exit_code=None, error=f"killed at its timeout of {timeout_s:g} s")
    elif proc.returncode:
        out["error"] = f"exited with status {proc.returncode}"
    if output and "error" in out:
        out["output"] = output.decode(errors="replace")
    return out
