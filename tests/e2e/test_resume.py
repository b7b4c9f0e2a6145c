"""A resume in a real workflowd: what a step between two waits costs in commits."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.harness import running_daemon
from tests.helpers.http import writes_committed
from tests.helpers.wait import settled, wait_status

MODULES = ["tests.workflows.resume"]


async def test_a_step_before_a_quiet_wait_is_saved_with_it(short_tmp: Path) -> None:
    """A send whose resume runs a step and waits again costs two writes, not three.

    One for the callback (the sender's answer), one for the step with the wait set up again:
    a signal's setup tells nobody, so the step need not be durable before it.
    """
    address = str(short_tmp / "metrics.sock")
    sends = 20
    async with (
        running_daemon(short_tmp, MODULES, metrics={"listen": address}) as d,
        d.client() as c,
    ):
        await c.call("start", workflow="StepBetweenSignals", workflow_id="s")
        await wait_status(c, "s", "Waiting")
        await settled(c)
        before = await writes_committed(address)
        for i in range(1, sends + 1):
            assert await c.call("send", workflow_id="s", event="bump") == i
            await settled(c)  # one at a time: no write of one send merges with the next's
        writes = await writes_committed(address) - before
        data = (await c.call("show", workflow_id="s"))["data"]
        assert data == {"bumps": sends, "steps": sends}
    # Before, each send wrote three times: the step was made durable before the wait's setup.
    assert writes <= 2 * sends, f"{writes} writes for {sends} sends"


async def test_a_timer_set_up_after_a_step_fires_after_a_kill(short_tmp: Path) -> None:
    """The step and the timer set up after it are durable once the workflow waits on it.

    Killed (SIGKILL) while it waits, the daemon comes back to the step done and the timer
    armed: the step does not run again, the timer fires.
    """
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call("start", workflow="StepThenTimer", workflow_id="t", input={"after_s": 4.0})
        await wait_status(c, "t", "Waiting")
        await c.call("send", workflow_id="t", event="go")
        await settled(c)
        shown = await c.call("show", workflow_id="t")
        assert shown["status"] == "Waiting"
        assert shown["data"]["steps"] == 1
        await d.kill()
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await wait_status(c, "t", "Finished", limit_s=30)
        data = (await c.call("show", workflow_id="t"))["data"]
        assert data == {"steps": 1, "rang": True, "after_s": 4.0}
