"""Running one Step's action: async in the loop, sync in a worker thread, with its timeout."""

from __future__ import annotations

import contextlib
import inspect
import time
import types
from collections.abc import Awaitable, Callable
from typing import Any, TypeGuard

import anyio
import structlog

from daemon.core.statements import Step

log = structlog.get_logger()
#: Records a history entry of the workflow the step belongs to.
Note = Callable[[str, dict[str, Any]], None]
_PLAIN_CALLABLES = (types.FunctionType, types.MethodType)


async def run_step(step: Step, *, limiter: anyio.CapacityLimiter, note: Note) -> None:
    """Run a step's action to its end; raise what it raises, TimeoutError past its timeout."""
    started = time.perf_counter()
    if _is_async(step.action):
        with _deadline(step.timeout):
            await step.action()
    else:
        result = await _run_sync(step, limiter, note)
        if inspect.isawaitable(result):
            with _deadline(step.timeout):
                await result
    ms = round((time.perf_counter() - started) * 1000, 3)
    log.info("step_done", step=step.name, duration_ms=ms)
    note("step_done", {"step": step.name, "duration_ms": ms})


def _deadline(timeout: float | None) -> contextlib.AbstractContextManager[Any]:
    return anyio.fail_after(timeout) if timeout else contextlib.nullcontext()


async def _run_sync(step: Step, limiter: anyio.CapacityLimiter, note: Note) -> object:
    """Run a sync action in a worker thread; one that outlives its timeout is reported.

    A thread cannot be cancelled, so a cancel (shutdown, `cancel`) abandons it instead of
    waiting for it: a hung step must not hang the daemon. Its result is dropped and the
    step runs again after a restart, as for a crash.
    """
    run = anyio.to_thread.run_sync
    if step.timeout is None:
        return await run(step.action, limiter=limiter, abandon_on_cancel=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_report_slow, step.name, step.timeout, note)
        result = await run(step.action, limiter=limiter, abandon_on_cancel=True)
        tg.cancel_scope.cancel()
    return result


async def _report_slow(step: str, after_s: float, note: Note) -> None:
    await anyio.sleep(after_s)
    log.warning("step_slow", step=step, timeout_s=after_s, note="sync: cannot be cancelled")
    note("step_slow", {"step": step, "timeout_s": after_s})


def _is_async(fn: Any) -> TypeGuard[Callable[[], Awaitable[Any]]]:
    """Tell whether `fn` is an async function, as inspect.iscoroutinefunction does, but faster."""
    # A plain function or bound method (nearly every step) needs no trip through inspect.
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None and type(fn) in _PLAIN_CALLABLES:
        return bool(code.co_flags & inspect.CO_COROUTINE)
    return inspect.iscoroutinefunction(fn)
