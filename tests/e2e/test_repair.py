"""Seeing and repairing workflows through a real `workflowd`: graph, lint, goto, edit, undo, retry,
hold and gc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from daemon.control.dispatch import RepairTools
from daemon.ops.repairs import Repairs
from tests.helpers.client import Client
from tests.helpers.harness import REPO, Daemon, running_daemon, write_config
from tests.helpers.wait import eventually, shown_when, until, wait_status

MODULES = ["tests.workflows.repair"]


def _conforms(repairs: Repairs) -> RepairTools:
    return repairs  # mypy checks here that the repair service offers every repair op


class HeldDaemon(Daemon):
    """A daemon started with `--hold`."""

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start `workflowd --hold`."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.main", "--config", str(self.config), "--hold"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.tmp,
            )
        return self.proc


@asynccontextmanager
async def client(tmp: Path) -> AsyncIterator[tuple[Daemon, Client]]:
    """Run a daemon on the repair workflows and connect to it."""
    async with running_daemon(tmp, MODULES) as d, d.client() as c:
        yield d, c


async def error_code(c: Client, op: str, **fields: Any) -> str:
    """Send a request that must fail; return its error code."""
    response = await c.request(op, **fields)
    assert response["ok"] is False, response
    code: str = response["error"]["code"]
    return code


async def history(c: Client, wid: str, kind: str) -> list[dict[str, Any]]:
    """Return the workflow's history entries of one kind."""
    return [h for h in await c.call("history", workflow_id=wid) if h["kind"] == kind]


async def failed_payment(c: Client, wid: str) -> dict[str, Any]:
    """Start a Payment whose charge fails for good; return it once Failed."""
    await c.call("start", workflow="Payment", workflow_id=wid)
    shown: dict[str, Any] = await wait_status(c, wid, "Failed")
    return shown


async def waiting_review(c: Client, wid: str) -> dict[str, Any]:
    """Start a Review and return it once it waits for its verdict."""
    await c.call("start", workflow="Review", workflow_id=wid)
    shown: dict[str, Any] = await wait_status(c, wid, "Waiting")
    return shown


def main_thread(shown: dict[str, Any]) -> dict[str, Any]:
    """Return the main thread of a shown workflow."""
    (t,) = [t for t in shown["state"]["threads"] if t["id"] == "_main_"]
    assert isinstance(t, dict)
    return t


class TestRetryAndEdit:
    """A failed workflow is fixed by editing its data and retrying it."""

    async def test_edit_then_retry(self, short_tmp: Path) -> None:
        """Edit is checked and recorded; retry resumes from the failing step."""
        async with client(short_tmp) as (_, c):
            shown = await failed_payment(c, "p1")
            assert "declined" in shown["error"]
            assert await error_code(c, "edit", workflow_id="p1", set={"card": 5}) == "bad_input"
            assert await error_code(c, "edit", workflow_id="p1", set={"nope": 1}) == "bad_request"
            assert await error_code(c, "edit", workflow_id="p1", set={}) == "bad_request"
            edited = await c.call("edit", workflow_id="p1", set={"card": "valid"})
            assert edited["status"] == "Failed" and edited["data"]["card"] == "valid"
            (entry,) = await history(c, "p1", "edit")
            assert entry["uid"] == os.getuid()
            assert (entry["before"], entry["after"]) == ({"card": "expired"}, {"card": "valid"})
            await c.call("retry", workflow_id="p1")
            done = await wait_status(c, "p1", "Finished")
            assert done["data"]["log"] == ["prepare", "charge", "receipt"]
            assert done["data"]["charged"] is True and done["error"] is None
            assert await error_code(c, "retry", workflow_id="p1") == "conflict"
            assert await error_code(c, "edit", workflow_id="p1", set={"card": "x"}) == "conflict"
            (retried,) = await history(c, "p1", "retry")
            assert "declined" in retried["error"]

    async def test_retry_keeps_the_deadline(self, short_tmp: Path) -> None:
        """A retried workflow is still cancelled at its deadline; past it, retry is refused."""
        async with client(short_tmp) as (_, c):
            await c.call("start", workflow="Bollard", workflow_id="g1", timeout_s=5.0)
            await c.call("start", workflow="Bollard", workflow_id="g2", timeout_s=0.5)
            await wait_status(c, "g1", "Failed")
            await c.call("edit", workflow_id="g1", set={"open": True})
            await c.call("retry", workflow_id="g1")
            shown = await wait_status(c, "g1", "Cancelled")
            assert shown["error"] == "deadline passed"
            late = await wait_status(c, "g2", "Failed")
            await until(lambda: time.time() > late["deadline"])
            await c.call("edit", workflow_id="g2", set={"open": True})
            refused = await c.request("retry", workflow_id="g2")
            assert refused["error"]["code"] == "conflict"
            assert "deadline passed" in refused["error"]["message"]
            assert (await c.call("show", workflow_id="g2"))["status"] == "Failed"


class TestGoto:
    """goto moves a thread; the engine then does what the target statement means."""

    async def test_skip_the_failing_step(self, short_tmp: Path) -> None:
        """A failed workflow jumps past its failing step and finishes."""
        async with client(short_tmp) as (_, c):
            await failed_payment(c, "p1")
            moved = await c.call(
                "goto", workflow_id="p1", thread_id="_main_", statement="send_receipt"
            )
            assert moved["thread"]["status"] == "Executing"
            done = await wait_status(c, "p1", "Finished")
            assert (done["data"]["charged"], done["data"]["receipt"]) == (False, True)
            (entry,) = await history(c, "p1", "goto")
            assert entry["uid"] == os.getuid() and entry["statement"] == "send_receipt"
            # The stored thread names the step that failed (it is checkpointed when it starts).
            assert entry["before"]["cur_step"] == "charge"
            assert entry["after"] == {
                "status": "Executing",
                "cur_step": "send_receipt",
                "cur_callback": "",
            }
            assert (
                await error_code(
                    c, "goto", workflow_id="p1", thread_id="_main_", statement="charge"
                )
                == "conflict"
            )

    async def test_event_case_then_wait_for_then_edit(self, short_tmp: Path) -> None:
        """goto an event runs its case; goto a WaitFor waits there until an edit makes it true."""
        async with client(short_tmp) as (_, c):
            await waiting_review(c, "r1")
            await c.call("goto", workflow_id="r1", thread_id="_main_", statement="decide")
            shown = await wait_status(c, "r1", "Waiting")
            with anyio.fail_after(20):
                while main_thread(shown)["cur_step"] != "second":
                    await anyio.sleep(0.02)
                    shown = await c.call("show", workflow_id="r1")
            assert shown["data"]["log"] == ["decided", "accepted"]
            assert set(shown["waiting_for"]) == {"nudge", "again", "second_late"}
            await c.call("goto", workflow_id="r1", thread_id="_main_", statement="ready_wait")
            with anyio.fail_after(20):
                while set(shown["waiting_for"]) != {"nudge"}:  # the Wait's cases are torn down
                    await anyio.sleep(0.02)
                    shown = await c.call("show", workflow_id="r1")
            assert main_thread(shown)["status"] == "WaitingCondition"
            await c.call("edit", workflow_id="r1", set={"ready": True})
            done = await wait_status(c, "r1", "Finished")
            assert done["data"]["log"] == ["decided", "accepted", "finished"]

    async def test_branch_then_loop(self, short_tmp: Path) -> None:
        """goto a branch runs its body whatever its condition; goto a For re-enters the loop."""
        async with client(short_tmp) as (_, c):
            await waiting_review(c, "r1")
            await c.call("goto", workflow_id="r1", thread_id="_main_", statement="rejected")

            async def at(step: str) -> bool:
                shown = await c.call("show", workflow_id="r1")
                return bool(main_thread(shown)["cur_step"] == step and shown["status"] == "Waiting")

            await eventually(lambda: at("second"))
            shown = await c.call("show", workflow_id="r1")
            assert shown["data"]["log"] == ["rejected"]
            await c.call("goto", workflow_id="r1", thread_id="_main_", statement="rounds_loop")
            await eventually(lambda: at("ask"))
            shown = await c.call("show", workflow_id="r1")
            assert set(shown["waiting_for"]) == {"nudge", "decide", "late"}

    async def test_refusals(self, short_tmp: Path) -> None:
        """Unknown threads and statements, other threads' statements and busy workflows are refused."""
        async with client(short_tmp) as (_, c):
            await waiting_review(c, "r1")
            for thread, statement, code in [
                ("nope", "decide", "not_found"),
                ("_main_", "nope", "not_found"),
                ("_main_", "nudged", "not_found"),  # the side thread's step
                ("_main_", "side", "not_found"),  # a Go
                ("side", "count", "not_found"),
            ]:
                fields = {"workflow_id": "r1", "thread_id": thread, "statement": statement}
                assert await error_code(c, "goto", **fields) == code, (thread, statement)
            await c.call("goto", workflow_id="r1", thread_id="side", statement="nudged")
            assert await error_code(c, "goto", workflow_id="x", thread_id="a", statement="b") == (
                "not_found"
            )
            await c.call("start", workflow="Slow", workflow_id="s1")
            await wait_status(c, "s1", "Resuming")
            fields = {"workflow_id": "s1", "thread_id": "_main_", "statement": "sleep"}
            assert await error_code(c, "goto", **fields) == "conflict"
            assert await error_code(c, "edit", workflow_id="s1", set={}) in (
                "conflict",
                "bad_request",
            )
            await c.call("cancel", workflow_id="s1")
            # The side thread runs "nudged" after the goto, in its own time.
            await shown_when(c, "r1", lambda shown: "nudged" in shown["data"]["log"])


class TestUndo:
    """undo puts back data and state from before the last goto or edit."""

    async def test_undo_goto(self, short_tmp: Path) -> None:
        """After undoing a goto the workflow waits where it was and takes its events."""
        async with client(short_tmp) as (_, c):
            await waiting_review(c, "r1")
            await c.call("goto", workflow_id="r1", thread_id="_main_", statement="second")
            shown = await c.call("show", workflow_id="r1")
            with anyio.fail_after(20):
                while "again" not in shown["waiting_for"]:
                    await anyio.sleep(0.02)
                    shown = await c.call("show", workflow_id="r1")
            undone = await c.call("undo", workflow_id="r1")
            assert undone == {"workflow_id": "r1", "status": "Waiting", "reverted": "goto"}
            shown = await c.call("show", workflow_id="r1")
            assert set(shown["waiting_for"]) == {"nudge", "decide", "late"}
            assert await c.call("send", workflow_id="r1", event="decide", input="no") == "got no"
            with anyio.fail_after(20):
                while "rejected" not in shown["data"]["log"]:
                    await anyio.sleep(0.02)
                    shown = await c.call("show", workflow_id="r1")

    async def test_undo_edits_in_turn(self, short_tmp: Path) -> None:
        """Each undo reverts one more edit, until none is left."""
        async with client(short_tmp) as (_, c):
            await failed_payment(c, "p1")
            await c.call("edit", workflow_id="p1", set={"card": "a"})
            await c.call("edit", workflow_id="p1", set={"card": "b"})
            for card in ("a", "expired"):
                await c.call("undo", workflow_id="p1")
                shown = await c.call("show", workflow_id="p1")
                assert (shown["data"]["card"], shown["status"]) == (card, "Failed")
            assert await error_code(c, "undo", workflow_id="p1") == "conflict"
            assert len(await history(c, "p1", "undo")) == 2


class TestHold:
    """`workflowd --hold` runs nothing until released, but answers."""

    async def test_hold_resume_and_resume_all(self, short_tmp: Path) -> None:
        """Held workflows stay put; resume releases one, resume-all the rest."""
        async with client(short_tmp) as (_, c):
            for wid in ("t1", "t2"):
                await c.call("start", workflow="Ticks", workflow_id=wid, input={"after": 0.3})
                await wait_status(c, wid, "Waiting")
            await waiting_review(c, "r1")
        timers_due_by = time.time() + 0.3  # t1's and t2's deadlines are no later than this
        held = HeldDaemon(short_tmp, write_config(short_tmp, MODULES))
        await held.start()
        try:
            async with held.client() as c:
                assert (await c.call("show", workflow_id="t1"))["held"] is True
                rec = [r for r in held.records() if r["event"] == "recovered"][-1]
                assert (rec["held"], rec["resumed"], rec["armed"]) == (3, 0, 0)
                fields = {"workflow_id": "r1", "event": "decide", "input": "yes"}
                assert await error_code(c, "send", **fields) == "unavailable"
                assert await c.call("send", **fields, wait=False) == {"queued": True}
                await c.call("start", workflow="Ticks", workflow_id="t3", input={"after": 0.0})
                # t3 is due now. Watch the held daemon, up and serving, for 0.3 s past every
                # deadline: a held timer must not fire. The window starts no earlier than now,
                # so the daemon's start-up time cannot use it up. (This sleep is the behaviour
                # under test: that nothing happens.)
                watch_until = max(timers_due_by, time.time()) + 0.3
                await anyio.sleep(watch_until - time.time())
                for wid in ("t1", "t2", "t3", "r1"):
                    assert (await c.call("show", workflow_id=wid))["held"] is True
                assert (await c.call("show", workflow_id="t1"))["status"] == "Waiting"
                assert (await c.call("show", workflow_id="t3"))["status"] == "Resuming"
                assert (await c.call("resume", workflow_id="t1"))["released"] is True
                shown = await wait_status(c, "t1", "Finished")
                assert shown["data"]["fired"] is True and "held" not in shown
                assert (await c.call("show", workflow_id="t2"))["status"] == "Waiting"
                assert await c.call("resume-all") == {"released": 3}
                for wid in ("t2", "t3"):
                    await wait_status(c, wid, "Finished")

                async def verdict() -> bool:  # the queued verdict is applied once released
                    return bool(
                        (await c.call("show", workflow_id="r1"))["data"]["verdict"] == "yes"
                    )

                await eventually(verdict)
                assert await c.call("resume-all") == {"released": 0}
        finally:
            await held.stop()


class TestSeeing:
    """graph, lint and gc through the daemon and workflowctl."""

    async def test_graph_lint_gc(self, short_tmp: Path) -> None:
        """Diagrams, checks (also logged at start) and retention answer over the socket."""
        async with client(short_tmp) as (d, c):
            text = await c.call("graph", workflow="Review")
            assert text.startswith("---\ntitle: Review\n---\nflowchart TD")
            await waiting_review(c, "r1")
            dot = await c.call("graph", workflow="Review", workflow_id="r1", format="dot")
            assert 'label="_main_: WaitingEvent"' in dot and 'fillcolor="#bfdbfe"' in dot
            assert await error_code(c, "graph", workflow="Needs") == "bad_request"
            assert await error_code(c, "graph", workflow="Nope") == "not_found"
            assert await error_code(c, "graph", workflow="Payment", workflow_id="r1") == "conflict"
            assert await error_code(c, "graph", workflow="Review", format="png") == "bad_request"
            found = await c.call("lint", workflow="Review")
            assert [(f["level"], f["code"], f["statement"]) for f in found] == [
                ("warning", "no_timeout", "nudge_wait")
            ]
            dupes = await c.call("lint", workflow="Dupes")
            assert [(f["level"], f["code"]) for f in dupes] == [("error", "duplicate_name")]
            logged = {(r["event"], r["workflow"]) for r in d.records() if "lint" in r["event"]}
            assert {("lint_warning", "Review"), ("lint_error", "Dupes")} <= logged
            await c.call("start", workflow="Payment", workflow_id="ok", input={"card": "valid"})
            await wait_status(c, "ok", "Finished")
            assert (await c.call("gc"))["deleted"] == 0
            assert (await c.call("gc", keep_days=0))["deleted"] == 1
            assert await error_code(c, "show", workflow_id="ok") == "not_found"
            assert await error_code(c, "gc", keep_days=-1) == "bad_request"

    async def test_workflowctl(self, short_tmp: Path) -> None:
        """workflowctl draws (svg without Graphviz), lints with an exit code, edits."""
        async with client(short_tmp) as (d, c):
            await failed_payment(c, "p1")

            def ctl(*args: str, path: str = "") -> subprocess.CompletedProcess[str]:
                env = {**os.environ, "PATH": path or os.environ.get("PATH", "")}
                cmd = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(d.socket), *args]
                return subprocess.run(
                    cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False
                )

            # No `dot` on this PATH: the SVG is drawn by workflowd, with where the thread is.
            svg = ctl("graph", "Payment", "p1", "--format", "svg", path=str(short_tmp))
            assert svg.returncode == 0, svg.stderr
            assert svg.stdout.startswith("<svg") and svg.stdout.rstrip().endswith("</svg>")
            assert "_main_: " in svg.stdout
            assert "digraph workflow {" in ctl("graph", "Payment", "--format", "dot").stdout
            assert ctl("graph", "Payment").stdout.startswith("---\ntitle: Payment")
            bad = ctl("lint", "Dupes")
            assert bad.returncode == 1 and "duplicate_name" in bad.stdout
            assert ctl("lint", "Payment").stdout.strip() == "no findings"
            edited = ctl("edit", "p1", "--set", 'card="valid"', "--set", "log=[]")
            assert edited.returncode == 0, edited.stderr
            assert (await c.call("show", workflow_id="p1"))["data"]["log"] == []
            assert ctl("retry", "p1").returncode == 0
            await wait_status(c, "p1", "Finished")
