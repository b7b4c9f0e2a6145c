"""Recovery checks stored state against the code, as reload does, through a real `workflowd`.

A workflow that does not fit the code it restarts with (a renamed statement, a corrupt row) is
held with the reason instead of being run into a failure; a reload or restart with code it fits
releases it. Also: what `reload` says about settings that need a restart.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.helpers.client import Client
from tests.helpers.harness import REPO, Daemon, running_daemon, write_config
from tests.helpers.wait import logged, shown_when, wait_status

MODULE = "recovery_flows"  # written into each test's tmp_path, so every test has its own copy

_HEAD = """
from dataclasses import dataclass

from daemon import On, S, Section, Step, Wait, Workflow
from handlers import Signal


@dataclass
class Memo(Workflow):
    note: str = ""
    done: bool = False

    def finish(self) -> None:
        self.done = True
"""
#: What the daemon starts with: the workflow waits at the Wait `approval`.
V1 = (
    _HEAD
    + """
    def definition(self) -> Section:
        return S(Wait("approval", On("approve", Signal())), Step("finish", self.finish))
"""
)
#: The Wait renamed: a workflow waiting at `approval` no longer fits.
RENAMED = (
    _HEAD
    + """
    def definition(self) -> Section:
        return S(Wait("sign_off", On("approve", Signal())), Step("finish", self.finish))
"""
)
#: A later release that fits again (the old name is back, a step was added).
FITS = (
    _HEAD
    + """
    def definition(self) -> Section:
        return S(
            Wait("approval", On("approve", Signal())),
            Step("finish", self.finish),
            Step("tidy", lambda: None),
        )
"""
)


def write(folder: Path, source: str) -> None:
    """Write one version of the workflow module into the test's folder."""
    (folder / f"{MODULE}.py").write_text(source)


def daemon(tmp: Path, **sections: dict[str, Any]) -> Daemon:
    """A daemon (not started) on the test's own copy of the workflow module."""
    paths = {"workflows": {"paths": [str(REPO), str(tmp)]}}
    return Daemon(tmp, write_config(tmp, [MODULE], **paths, **sections))


async def workflowctl(sock: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run workflowctl against `sock` and return the finished process."""
    argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(sock), *args]
    return await anyio.run_process(argv, cwd=REPO, check=False)


async def refused(c: Client, op: str, **fields: Any) -> dict[str, Any]:
    """Send a request that must fail; return its error."""
    response = await c.request(op, **fields)
    assert response["ok"] is False, response
    error: dict[str, Any] = response["error"]
    return error


async def waiting(d: Daemon, ids: list[str]) -> None:
    """Start a Memo for each id and wait until all of them wait at `approval`."""
    async with d.client() as c:
        for wid in ids:
            await c.call("start", workflow="Memo", workflow_id=wid)
        for wid in ids:
            await wait_status(c, wid, "Waiting")


class TestIncompatibleAtStart:
    @pytest.mark.sqlite_only("writes the inbox into the SQLite file")
    async def test_held_with_the_reason_until_code_fits(self, short_tmp: Path) -> None:
        """A restart on code it does not fit holds it (send: conflict); goto, reload, restart free it."""
        write(short_tmp, V1)
        d = daemon(short_tmp)
        await d.start()
        try:
            await waiting(d, ["by_goto", "cancelled", "by_reload", "by_restart"])
            assert await d.stop() == 0
            with sqlite3.connect(short_tmp / "wd.db") as db:  # as `send --no-wait` leaves it
                db.execute(
                    "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at)"
                    " VALUES ('by_reload', 'approve', '', 0, 'null', 0)"
                )
            db.close()
            write(short_tmp, RENAMED)
            await d.start()
            async with d.client() as c:
                for wait in (True, False):
                    error = await refused(
                        c, "send", workflow_id="by_goto", event="approve", wait=wait
                    )
                    assert error["code"] == "conflict"
                    assert "statement 'approval' is gone" in error["message"]
                shown = await c.call("show", workflow_id="by_goto")
                assert shown["status"] == "Waiting" and shown["held"] is True
                assert "statement 'approval' is gone" in shown["incompatible"]
                listed = {e["workflow_id"]: e for e in await c.call("list")}
                assert "'approval' is gone" in listed["by_reload"]["incompatible"]
                assert (await c.call("ping"))["incompatible"] == 4
                [record] = await logged(d, "workflow_incompatible", workflow_id="by_goto")
                assert "statement 'approval' is gone" in record["reason"]
                recovered = (await logged(d, "recovered"))[-1]
                assert recovered["incompatible"] == 4 and recovered["armed"] == 0
                # Nothing ran it into a failure.
                assert (await c.call("show", workflow_id="by_goto"))["status"] == "Waiting"

                # cancel, edit and goto still work.
                assert (await c.call("cancel", workflow_id="cancelled"))["status"] == "Cancelled"
                edited = await c.call("edit", workflow_id="by_reload", set={"note": "kept"})
                assert edited["data"]["note"] == "kept"
                assert "'approval' is gone" in edited["incompatible"]  # still held
                assert (await c.call("show", workflow_id="by_reload"))["incompatible"]
                moved = await c.call(
                    "goto", workflow_id="by_goto", thread_id="_main_", statement="sign_off"
                )
                assert "incompatible" not in moved  # it fits now
                freed = await shown_when(
                    c, "by_goto", lambda s: s["status"] == "Waiting" and not s["incompatible"]
                )
                assert "held" not in freed
                assert await c.call("send", workflow_id="by_goto", event="approve") is None
                assert (await wait_status(c, "by_goto", "Finished"))["data"]["done"] is True
                assert (await c.call("ping"))["incompatible"] == 2

                # A reload that still does not fit them is not refused: it reports them.
                again = await c.call("reload")
                assert again["reloaded"] is True
                held = {h["workflow_id"]: h["reason"] for h in again["incompatible"]}
                assert set(held) == {"by_reload", "by_restart"}
                assert "'approval' is gone" in held["by_reload"]
                # A reload with code they fit releases them.
                write(short_tmp, FITS)
                done = await workflowctl(d.socket, "reload")
                assert done.returncode == 0, done.stderr
                assert "still held" not in done.stdout.decode()
                assert (await c.call("ping"))["incompatible"] == 0
                assert (await c.call("show", workflow_id="by_reload"))["incompatible"] is None
                # The event acknowledged before the restart was kept for it, and is applied now.
                finished = await wait_status(c, "by_reload", "Finished")
                assert finished["data"] == {"note": "kept", "done": True}
                assert (await c.call("show", workflow_id="cancelled"))["status"] == "Cancelled"

            # A restart with code it fits releases it too.
            assert await d.stop() == 0
            write(short_tmp, RENAMED)
            await d.start()
            async with d.client() as c:
                assert (await c.call("ping"))["incompatible"] == 1
            assert await d.stop() == 0
            write(short_tmp, V1)
            await d.start()
            async with d.client() as c:
                assert (await c.call("ping"))["incompatible"] == 0
                assert await c.call("send", workflow_id="by_restart", event="approve") is None
                await wait_status(c, "by_restart", "Finished")
        finally:
            if d.proc is not None and d.proc.poll() is None:
                await d.stop()


class TestReloadNeedsRestart:
    async def test_every_reload_names_the_keys_still_to_apply(self, short_tmp: Path) -> None:
        """A changed restart-only key is reported by each reload until the config is put back."""
        write(short_tmp, V1)
        paths = {"paths": [str(REPO), str(short_tmp)]}
        async with running_daemon(short_tmp, [MODULE], workflows=paths) as d, d.client() as c:
            write_config(short_tmp, [MODULE], workflows=paths, store={"history_keep": 5})
            for _ in range(2):
                assert (await c.call("reload"))["needs_restart"] == ["store.history_keep"]
            done = await workflowctl(d.socket, "reload")  # as `systemctl reload` runs it
            assert done.returncode == 0, done.stderr
            assert "needs a restart: store.history_keep" in done.stdout.decode().splitlines()
            write_config(short_tmp, [MODULE], workflows=paths)  # back to what it runs on
            assert (await c.call("reload"))["needs_restart"] == []
            done = await workflowctl(d.socket, "reload")
            assert done.returncode == 0 and b"needs a restart" not in done.stdout


class TestCorruptRows:
    @pytest.mark.sqlite_only("corrupts rows in the SQLite file")
    async def test_explained_cancellable_and_never_block_reload(self, short_tmp: Path) -> None:
        """Rows that do not decode or fit: send/edit say why, cancel works, reload goes through."""
        write(short_tmp, V1)
        d = daemon(short_tmp)
        bad = {
            "bad_data": ("UPDATE workflows SET data = '{not json' WHERE id = ?", "its data"),
            "bad_state": ("UPDATE workflows SET state = '[1,' WHERE id = ?", "its state"),
            "ghost": ("UPDATE workflows SET name = 'Vanished' WHERE id = ?", "'Vanished'"),
            "bad_types": (
                """UPDATE workflows SET data = '{"note": 5}' WHERE id = ?""",
                "Expected `str`",
            ),
            "gone_step": ("", "statement 'nope' is gone"),
        }
        await d.start()
        try:
            await waiting(d, ["good", *bad])
            assert await d.stop() == 0
            with sqlite3.connect(short_tmp / "wd.db") as db:
                for wid, (sql, _) in bad.items():
                    if sql:
                        db.execute(sql, (wid,))
                (text,) = db.execute(
                    "SELECT state FROM workflows WHERE id = 'gone_step'"
                ).fetchone()
                state = json.loads(text)
                state["threads"][0]["cur_step"] = "nope"
                db.execute(
                    "UPDATE workflows SET state = ? WHERE id = 'gone_step'", (json.dumps(state),)
                )
                # Events acknowledged for a workflow that is gone, and for two that get cancelled.
                for wid in ("nobody", "bad_state", "gone_step"):
                    db.execute(
                        "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at)"
                        " VALUES (?, 'approve', '', 0, 'null', 0)",
                        (wid,),
                    )
            db.close()
            await d.start()
            async with d.client() as c:
                for wid, (_, why) in bad.items():
                    error = await refused(c, "send", workflow_id=wid, event="approve")
                    assert error["code"] == "conflict" and why in error["message"], error
                    if wid != "gone_step":  # it decodes: an edit of it is a repair (see above)
                        error = await refused(c, "edit", workflow_id=wid, set={"note": "x"})
                        assert error["code"] == "conflict" and why in error["message"], error
                    shown = await c.call("show", workflow_id=wid)
                    assert why in shown["incompatible"], shown
                assert (await c.call("ping"))["incompatible"] == len(bad)
                reloaded = await c.call("reload")
                assert reloaded["reloaded"] is True, reloaded
                assert {h["workflow_id"] for h in reloaded["incompatible"]} == set(bad)
                for wid in bad:
                    assert (await c.call("cancel", workflow_id=wid))["status"] == "Cancelled"
                    assert (await c.call("show", workflow_id=wid))["status"] == "Cancelled"
                assert (await c.call("ping"))["incompatible"] == 0
                assert await c.call("send", workflow_id="good", event="approve") is None
                await wait_status(c, "good", "Finished")
            await logged(d, "inbox_dropped", workflow_id="nobody")
            assert await d.stop() == 0
            with sqlite3.connect(short_tmp / "wd.db") as db:
                assert db.execute("SELECT COUNT(*) FROM inbox").fetchone() == (0,)
            db.close()
        finally:
            if d.proc is not None and d.proc.poll() is None:
                await d.stop()
