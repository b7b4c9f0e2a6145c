"""Wait for a condition with a ceiling, never a fixed sleep (pueue's tests/helper/wait.rs).

Every helper polls until its condition holds and fails the test (TimeoutError) once `limit_s`
passes; none asserts a snapshot of workflows that are still moving.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from daemon.runtime.runtime import Runtime
from tests.helpers.client import Client
from tests.helpers.harness import Daemon


async def eventually(check: Callable[[], Awaitable[bool]], limit_s: float = 10.0) -> None:
    """Poll an async condition until it holds."""
    with anyio.fail_after(limit_s):
        while True:
            if await check():
                return
            await anyio.sleep(0.01)


async def until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll a plain condition (on files, fds, /proc or an object) until it holds."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110 - /proc and the file system have no event to await
            await anyio.sleep(0.01)


async def wait_runtime_status(
    rt: Runtime, wid: str, status: str, limit_s: float = 10.0
) -> dict[str, Any]:
    """Wait until a workflow of an in-process runtime reaches `status`; return `show`."""
    with anyio.fail_after(limit_s):
        while True:
            await rt.wait_idle()
            shown = await rt.show(wid)
            if shown["status"] == status:
                return shown
            await anyio.sleep(0.01)


async def wait_status(c: Client, workflow_id: str, *statuses: str, limit_s: float = 20) -> Any:
    """Poll a daemon's `show` until the workflow reaches one of `statuses`; return it."""
    with anyio.fail_after(limit_s):
        while True:
            shown = await c.call("show", workflow_id=workflow_id)
            if shown["status"] in statuses:
                return shown
            await anyio.sleep(0.02)


async def shown_when(
    c: Client, workflow_id: str, check: Callable[[dict[str, Any]], bool], limit_s: float = 20
) -> dict[str, Any]:
    """Poll a daemon's `show` until `check` holds for the workflow; return it."""
    with anyio.fail_after(limit_s):
        while True:
            shown: dict[str, Any] = await c.call("show", workflow_id=workflow_id)
            if check(shown):
                return shown
            await anyio.sleep(0.02)


async def logged(
    d: Daemon, event: str, count: int = 1, limit_s: float = 20, **match: Any
) -> list[dict[str, Any]]:
    """Poll the daemon's log until `event` (with fields `match`) was logged `count` times."""
    with anyio.fail_after(limit_s):
        while True:
            found = [
                r
                for r in d.records()
                if r.get("event") == event and all(r.get(k) == v for k, v in match.items())
            ]
            if len(found) >= count:
                return found
            if d.proc is not None and d.proc.poll() is not None:
                raise AssertionError(f"workflowd died waiting for {event}:\n{d.output()}")
            await anyio.sleep(0.02)


async def settled(c: Client, limit_s: float = 20) -> dict[str, Any]:
    """Poll ping until the daemon is quiet (`busy == 0`: no step, callback or resume in flight).

    Returns that ping's result, whose `workflows` counts are then a stable picture unless a
    timer is still due. A workflow sleeping until its next retry does not count as busy.
    """
    with anyio.fail_after(limit_s):
        while True:
            pinged: dict[str, Any] = await c.call("ping")
            if pinged["busy"] == 0:
                return pinged
            await anyio.sleep(0.02)
