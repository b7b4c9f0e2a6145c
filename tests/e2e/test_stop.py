"""Stopping: a stop request repeated while the daemon exits still ends in a clean exit 0."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio

from tests.helpers.harness import running_daemon
from tests.helpers.wait import wait_status

MODULES = ["tests.workflows.e2e"]


async def test_repeated_sigterm_exits_0(tmp_path: Path) -> None:
    """SIGTERM sent again and again (a supervisor insisting) until the process is gone: exit 0."""
    async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
        await c.call("start", workflow="Turnstile", workflow_id="t1", input={"need": 1})
        await wait_status(c, "t1", "Waiting")
        proc = d.proc
        assert proc is not None
        with anyio.fail_after(30):
            while proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                await anyio.sleep(0.002)  # the repetition is the behaviour under test
        assert proc.returncode == 0, d.output()[-2000:]
