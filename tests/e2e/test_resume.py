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


async def test_a_fired_timer_and_its_quick_step_are_one_write(short_tmp: Path) -> None:
    """A fired timer whose resume runs a quick sync step and waits again (or ends) is saved once.

    The checkpoint taken as the step starts acknowledges nothing: it is held back a moment,
    and the save after the step merges into it. Before, each fire wrote twice (that
    checkpoint went in flight while the step ran in its worker thread). A step that takes
    longer than the hold (a loaded box) still gets its own write, hence the margin.
    """
    address = str(short_tmp / "metrics.sock")
    fires = 20
    async with (
        running_daemon(short_tmp, MODULES, metrics={"listen": address}) as d,
        d.client() as c,
    ):
        await c.call("start", workflow="TimerThenStep", workflow_id="t", input={"n": 0})
        await wait_status(c, "t", "Finished")
        await settled(c)
        before = await writes_committed(address)
        await c.call("start", workflow="TimerThenStep", workflow_id="u", input={"n": fires})
        shown = await wait_status(c, "u", "Finished", limit_s=30)
        await settled(c)
        writes = await writes_committed(address) - before
        assert shown["data"]["steps"] == fires
        history = await c.call("history", workflow_id="u")
    done = [e for e in history if e["kind"] == "step_done"]
    assert len(done) == fires
    # Its start (a create, the first wait's save) and one write per fire: 23 here, where the
    # old path wrote 43. Half the fires may find the box too busy for their step to be quick.
    assert writes <= 3 + 1.5 * fires, f"{writes} writes for {fires} fires"
