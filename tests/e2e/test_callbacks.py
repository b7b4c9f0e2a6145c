"""Durable callbacks in a real workflowd: what one costs in commits, and when it is answered."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.helpers.client import Client
from tests.helpers.disk import hold_write_lock
from tests.helpers.harness import running_daemon
from tests.helpers.http import writes_committed
from tests.helpers.wait import settled, wait_status

MODULES = ["tests.workflows.callbacks"]


def _data(db: Path, workflow_id: str) -> dict[str, Any]:
    """Return a workflow's data as committed to the database file."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        (data,) = conn.execute("SELECT data FROM workflows WHERE id = ?", (workflow_id,)).fetchone()
    finally:
        conn.close()
    loaded: dict[str, Any] = json.loads(data)
    return loaded


async def test_a_callback_and_the_resume_it_starts_are_one_write(short_tmp: Path) -> None:
    """A `send` that wakes a workflow costs one write: its callback and the re-armed wait."""
    address = str(short_tmp / "metrics.sock")
    sends = 20
    async with (
        running_daemon(short_tmp, MODULES, metrics={"listen": address}) as d,
        d.client() as c,
    ):
        await c.call("start", workflow="BumpCounter", workflow_id="t")
        await wait_status(c, "t", "Waiting")
        await settled(c)
        before = await writes_committed(address)
        for i in range(1, sends + 1):
            assert await c.call("send", workflow_id="t", event="bump", input=1) == i
        await settled(c)
        writes = await writes_committed(address) - before
        assert (await c.call("show", workflow_id="t"))["data"]["count"] == sends
    # Before, each send wrote twice: the callback, then the wait set up again.
    assert writes <= sends + 1, f"{writes} writes for {sends} sends"


@pytest.mark.sqlite_only("reads the database file")
async def test_an_answered_send_is_in_the_database_file(short_tmp: Path) -> None:
    """The answer to a `send` comes once its callback is committed, each time."""
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call("start", workflow="BumpCounter", workflow_id="t")
        await wait_status(c, "t", "Waiting")
        for i in range(1, 31):
            assert await c.call("send", workflow_id="t", event="bump", input=1) == i
            # Read from outside at once: the commit that holds it came before the answer.
            assert _data(short_tmp / "wd.db", "t")["count"] >= i


@pytest.mark.sqlite_only("reads the database file")
async def test_a_step_after_the_callback_does_not_hold_its_answer(short_tmp: Path) -> None:
    """A send whose resume runs a long step is answered while the step runs, once durable."""
    release = short_tmp / "release"
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call(
            "start", workflow="GateThenSlow", workflow_id="g", input={"release": str(release)}
        )
        await wait_status(c, "g", "Waiting")
        with anyio.fail_after(10):
            assert await c.call("send", workflow_id="g", event="go", input=7) == "going"
        # The step is still blocked (its file does not exist yet), and the callback is durable.
        stored = _data(short_tmp / "wd.db", "g")
        assert stored["got"] == 7 and stored["done"] is False
        assert (await c.call("show", workflow_id="g"))["status"] == "Resuming"
        await anyio.Path(release).touch()
        shown = await wait_status(c, "g", "Finished")
        assert shown["data"] == {"release": str(release), "got": 7, "done": True}


@pytest.mark.sqlite_only("locks the database file")
async def test_a_send_whose_write_fails_is_answered_unavailable_and_not_applied(
    short_tmp: Path,
) -> None:
    """The commit that would hold a callback fails: its sender hears `unavailable`, and the
    event is dropped, not applied later behind the sender's back."""
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call("start", workflow="BumpCounter", workflow_id="t")
        await wait_status(c, "t", "Waiting")
        lock = await anyio.to_thread.run_sync(hold_write_lock, short_tmp / "wd.db")
        try:
            sent = await c.request("send", workflow_id="t", event="bump", input=5)
            assert not sent["ok"] and sent["error"]["code"] == "unavailable", sent
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        # Once the store works again, the next send is the first one applied.
        assert await _sent(c) == 1
        await settled(c)
        assert (await c.call("show", workflow_id="t"))["data"]["count"] == 1
        assert _data(short_tmp / "wd.db", "t")["count"] == 1


async def _sent(c: Client, limit_s: float = 20) -> object:
    """Send one `bump` until it is answered ok (the workflow may still be backing off)."""
    with anyio.fail_after(limit_s):
        while True:
            sent = await c.request("send", workflow_id="t", event="bump", input=1)
            if sent["ok"]:
                return sent["result"]
            assert sent["error"]["code"] == "unavailable", sent
            await anyio.sleep(0.05)


async def test_each_callback_follows_the_definition_of_the_data_as_it_is(
    short_tmp: Path,
) -> None:
    """A definition that changes with the data (in a handler or in a step) is followed at once.

    The daemon keeps the definition it built between callbacks (to save rebuilding it): one
    kept past a change of the data would answer with the other mode's handler.
    """
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call("start", workflow="Toggle", workflow_id="t")
        await wait_status(c, "t", "Waiting")
        answers = [await c.call("send", workflow_id="t", event="poke", input=1) for _ in range(10)]
        assert answers == ["a->b", "b asked"] * 5
        shown = await wait_status(c, "t", "Waiting")
        assert shown["data"] == {"mode": "a", "asked": False}
