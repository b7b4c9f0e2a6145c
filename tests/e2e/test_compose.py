"""Workflows that compose, in a real `workflowd`: child workflows, Run command steps, deadlines.

A command's process group is read from /proc: once its step has ended (done, failed, timed
out, cancelled), no live process of that group may be left.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from tests.helpers.client import Client
from tests.helpers.harness import Daemon, running_daemon, write_config
from tests.helpers.wait import eventually, until, wait_status

MODULES = ["tests.workflows.compose"]


def group_members(pgid: int) -> list[int]:
    """Return the live (not zombie) processes of a process group."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            rest = stat.read_text().rpartition(")")[2]
        except OSError:
            continue
        fields = rest.split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def read_pid(path: Path) -> int:
    """Return the pid a command wrote to `path`, once it has."""
    return int(path.read_text().strip())


async def reaches(c: Client, wid: str, *statuses: str) -> dict[str, Any]:
    """Wait until a workflow that may not exist yet (a child) reaches one of `statuses`."""
    shown: dict[str, Any] = {}

    async def check() -> bool:
        nonlocal shown
        response = await c.request("show", workflow_id=wid)
        shown = response.get("result") or {}
        return response["ok"] and shown["status"] in statuses

    await eventually(check, limit_s=20)
    return shown


async def children(c: Client, parent: str) -> list[dict[str, Any]]:
    """Return `list --parent`."""
    rows: list[dict[str, Any]] = await c.call("list", parent=parent)
    return rows


async def history(c: Client, wid: str, kind: str) -> list[dict[str, Any]]:
    """Return a workflow's history entries of one kind."""
    rows: list[dict[str, Any]] = await c.call("history", workflow_id=wid)
    return [r for r in rows if r["kind"] == kind]


class TestChildren:
    """Child cases start a workflow and fire when it ends."""

    async def test_parent_gets_child_result(self, tmp_path: Path) -> None:
        """The child's `result()` reaches the parent's fn; show and list name both ends."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            kid_input = {"a": 2, "b": 40}
            await c.call(
                "start", workflow="Parent", workflow_id="p", input={"kid_input": kid_input}
            )
            shown = await wait_status(c, "p", "Finished")
            kid = "p/kid/1"
            assert shown["data"]["outcome"] == {
                "workflow_id": kid,
                "status": "Finished",
                "result": {"sum": 42},
                "error": None,
            }
            assert shown["children"] == [
                {"workflow_id": kid, "workflow": "Adder", "status": "Finished"}
            ]
            assert (await c.call("show", workflow_id=kid))["parent"] == "p"
            assert [r["workflow_id"] for r in await children(c, "p")] == [kid]
            graph = await c.call("graph", workflow="Parent", workflow_id="p")
            assert f"child {kid}: Finished" in graph

    async def test_child_failure_reaches_parent(self, tmp_path: Path) -> None:
        """A failed child fires its case with status Failed, its error and its data."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Parent", workflow_id="p", input={"kind": "Breaker"})
            shown = await wait_status(c, "p", "Finished")
            outcome = shown["data"]["outcome"]
            assert outcome["status"] == "Failed"
            assert "the child broke" in outcome["error"]
            assert outcome["result"] == {"note": "about to fail"}

    async def test_timer_wins_and_child_is_cancelled(self, tmp_path: Path) -> None:
        """A timer that beats the child tears its case down: the child is cancelled."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            race = {"kind": "Nest", "kid_input": {"level": 0}, "race_s": 0.5}
            await c.call("start", workflow="Parent", workflow_id="p", input=race)
            shown = await wait_status(c, "p", "Finished")
            assert shown["data"]["ended_by"] == "timer"
            kid = await reaches(c, "p/kid/1", "Cancelled")
            assert kid["parent"] == "p"

    async def test_sigkill_before_parent_checkpoint_starts_one_child(self, tmp_path: Path) -> None:
        """A crash after the child started but before the parent saved its wait: one child."""
        gate = tmp_path / "gate"
        config = write_config(tmp_path, MODULES)
        d = Daemon(tmp_path, config)
        await d.start()
        try:
            async with d.client() as c:
                await c.call(
                    "start", workflow="GatedParent", workflow_id="g", input={"gate": str(gate)}
                )

                async def started() -> bool:
                    return len(await children(c, "g")) == 1

                await eventually(started)
                # The parent's wait is not saved yet: its Gate's setup is still blocked.
                assert (await c.call("show", workflow_id="g"))["state"]["threads"][0][
                    "wait_events"
                ] == []
            await d.kill()
            gate.touch()
            await d.start()
            async with d.client() as c:
                shown = await wait_status(c, "g", "Waiting", "Finished")
                rows = await children(c, "g")
                assert [r["workflow_id"] for r in rows] == ["g/kid/1"]

                async def got_result() -> bool:
                    data = (await c.call("show", workflow_id="g"))["data"]
                    return bool(data["outcome"])

                await eventually(got_result)
                shown = await c.call("show", workflow_id="g")
                assert shown["data"]["outcome"]["result"] == {"sum": 5}
                assert len(await children(c, "g")) == 1
        finally:
            await d.stop()

    async def test_fan_out_recipe(self, tmp_path: Path) -> None:
        """The README's recipe: a Go per item starts one child each; WaitFor sees them all."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Release", workflow_id="rel", input={"nums": [1, 2, 3]})
            shown = await wait_status(c, "rel", "Finished")
            sums = sorted(o["result"]["sum"] for o in shown["data"]["built"].values())
            assert sums == [1, 2, 3]
            assert len(await children(c, "rel")) == 3

    async def test_cancel_cascades_three_levels(self, tmp_path: Path) -> None:
        """Cancelling the top of three nested workflows cancels all three."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Nest", workflow_id="n", input={"level": 2})
            await reaches(c, "n/kid/1/kid/1", "Waiting")
            assert (await c.call("cancel", workflow_id="n"))["status"] == "Cancelled"
            # The cancel is answered once the whole tree is down, children first.
            for wid in ("n", "n/kid/1", "n/kid/1/kid/1"):
                assert (await c.call("show", workflow_id=wid))["status"] == "Cancelled"
            top = await c.call("show", workflow_id="n")
            assert [k["workflow_id"] for k in top["children"]] == ["n/kid/1"]

    async def test_abandon_leaves_child_running(self, tmp_path: Path) -> None:
        """With on_parent_end="abandon", cancelling the parent leaves its child waiting."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            nest = {"level": 1, "abandon": True}
            await c.call("start", workflow="Nest", workflow_id="n", input=nest)
            await reaches(c, "n/kid/1", "Waiting")
            await c.call("cancel", workflow_id="n")
            await wait_status(c, "n", "Cancelled")
            assert (await c.call("show", workflow_id="n/kid/1"))["status"] == "Waiting"


class TestRun:
    """Run steps: a command in its own process group, its result in history and data."""

    async def test_success_into_field_and_history(self, tmp_path: Path) -> None:
        """The exit code and output land in `into` and in the history; show has the last run."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            argv = [
                sys.executable,
                "-c",
                "import sys; print('hello'); print('warn', file=sys.stderr)",
            ]
            await c.call("start", workflow="Command", workflow_id="r", input={"argv": argv})
            shown = await wait_status(c, "r", "Finished")
            assert shown["data"]["out"] == {"exit_code": 0, "stdout": "hello\n", "stderr": "warn\n"}
            (run,) = await history(c, "r", "command_run")
            assert run["exit_code"] == 0 and run["argv"] == argv and run["duration_ms"] > 0
            assert shown["last_run"]["stdout"] == "hello\n"

    async def test_success_leaves_no_process_behind(self, tmp_path: Path) -> None:
        """What a command leaves running in its group when it exits is ended with its step."""
        pidfile = tmp_path / "pid"
        script = f"sleep 60 > /dev/null 2>&1 & echo $$ > {pidfile}"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            argv = ["sh", "-c", script]
            await c.call("start", workflow="Command", workflow_id="r", input={"argv": argv})
            await wait_status(c, "r", "Finished")
            assert group_members(read_pid(pidfile)) == []

    async def test_failure_fails_the_step(self, tmp_path: Path) -> None:
        """An exit code not in ok_codes fails the step; its output is kept in the history."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            argv = ["sh", "-c", "echo broken >&2; exit 3"]
            await c.call("start", workflow="Command", workflow_id="r", input={"argv": argv})
            shown = await wait_status(c, "r", "Failed")
            assert "exited with code 3: broken" in shown["error"]
            (run,) = await history(c, "r", "command_run")
            assert run["exit_code"] == 3 and run["stderr"] == "broken\n"
            assert shown["data"]["out"] == {}

    async def test_timeout_kills_the_group(self, tmp_path: Path) -> None:
        """Past its timeout a command that ignores SIGTERM is SIGKILLed, group and all."""
        pidfile = tmp_path / "pid"
        # The leader ignores SIGTERM; a background member of its group stays until killed.
        script = f"trap '' TERM; sleep 60 & echo $$ > {pidfile}; wait; wait"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            start = {"argv": ["sh", "-c", script], "timeout": 0.5}
            await c.call("start", workflow="Command", workflow_id="r", input=start)
            await until(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
            pgid = read_pid(pidfile)
            assert group_members(pgid)
            shown = await wait_status(c, "r", "Failed", limit_s=30)
            assert "ran over its timeout of 0.5 s" in shown["error"]
            assert group_members(pgid) == []
            (run,) = await history(c, "r", "command_run")
            assert run["outcome"] == "timeout" and run["exit_code"] == -signal.SIGKILL
            assert run["duration_ms"] >= 5000  # SIGKILL came only after the 5 s grace

    async def test_cancel_kills_the_group(self, tmp_path: Path) -> None:
        """Cancelling a workflow whose command runs ends its whole process group."""
        pidfile = tmp_path / "pid"
        script = f"sleep 60 & echo $$ > {pidfile}; wait"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call(
                "start", workflow="Command", workflow_id="r", input={"argv": ["sh", "-c", script]}
            )
            await until(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
            pgid = read_pid(pidfile)
            assert len(group_members(pgid)) == 2
            assert (await c.call("cancel", workflow_id="r"))["status"] == "Cancelled"
            assert group_members(pgid) == []
            (run,) = await history(c, "r", "command_run")
            assert run["outcome"] == "cancelled" and run["exit_code"] == -signal.SIGTERM

    async def test_shutdown_kills_the_group(self, tmp_path: Path) -> None:
        """A daemon stopping past its grace period ends a running command's group."""
        pidfile = tmp_path / "pid"
        script = f"sleep 60 & echo $$ > {pidfile}; wait"
        daemon = {"shutdown_grace_s": 0.2}
        async with running_daemon(tmp_path, MODULES, daemon=daemon) as d, d.client() as c:
            await c.call(
                "start", workflow="Command", workflow_id="r", input={"argv": ["sh", "-c", script]}
            )
            await until(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
            pgid = read_pid(pidfile)
            assert group_members(pgid)
            await d.stop()
            assert group_members(pgid) == []

    async def test_output_is_capped(self, tmp_path: Path) -> None:
        """Only the last output_max_bytes of each stream are kept; the total is counted."""
        code = "import sys; sys.stdout.write('a' * 300000 + 'THE END')"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            start = {"argv": [sys.executable, "-c", code], "max_bytes": 1000}
            await c.call("start", workflow="Command", workflow_id="r", input=start)
            shown = await wait_status(c, "r", "Finished")
            out = shown["data"]["out"]["stdout"]
            assert len(out) == 1000 and out.endswith("THE END")
            (run,) = await history(c, "r", "command_run")
            assert run["stdout_bytes"] == 300007 and len(run["stdout"]) == 1000


class TestDeadline:
    """timeout_s: past it, the workflow is cancelled with error `deadline passed`."""

    async def test_class_deadline_cancels_workflow_and_child(self, tmp_path: Path) -> None:
        """A class's timeout_s cancels it and, per policy, its child; show has the deadline."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Deadline", workflow_id="dl")
            shown = await c.call("show", workflow_id="dl")
            assert shown["deadline"] > shown["created_at"]
            shown = await wait_status(c, "dl", "Cancelled")
            assert shown["error"] == "deadline passed"
            await reaches(c, "dl/kid/1", "Cancelled")

    async def test_deadline_kills_running_command(self, tmp_path: Path) -> None:
        """A command still running at the deadline is killed with its process group."""
        pidfile = tmp_path / "pid"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call(
                "start", workflow="Deadline", workflow_id="dl", input={"pidfile": str(pidfile)}
            )
            await until(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
            pgid = read_pid(pidfile)
            shown = await wait_status(c, "dl", "Cancelled")
            assert shown["error"] == "deadline passed"
            await until(lambda: group_members(pgid) == [])

    async def test_start_timeout_survives_a_crash(self, tmp_path: Path) -> None:
        """`start --timeout` sets a deadline that still holds after a SIGKILL and restart."""
        d = Daemon(tmp_path, write_config(tmp_path, MODULES))
        await d.start()
        try:
            async with d.client() as c:
                await c.call("start", workflow="Patient", workflow_id="pt", timeout_s=2.0)
                await wait_status(c, "pt", "Waiting")
            await d.kill()
            await d.start()
            async with d.client() as c:
                shown = await wait_status(c, "pt", "Cancelled")
                assert shown["error"] == "deadline passed"
                bad = await c.request("start", workflow="Patient", workflow_id="x", timeout_s=-1)
                assert bad["error"]["code"] == "bad_request"
        finally:
            await d.stop()

    async def test_workflowctl_start_timeout(self, tmp_path: Path) -> None:
        """`workflowctl start NAME --timeout S` is the deadline; the answer timeout goes first."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            ctl = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(d.socket)]
            done = await _run(
                [*ctl, "--timeout", "20", "start", "Patient", "--id", "w", "--timeout", "0.5"]
            )
            assert done == 0
            shown = await wait_status(c, "w", "Cancelled")
            assert shown["error"] == "deadline passed"
            listed = await _output([*ctl, "--json", "list", "--parent", "nobody"])
            assert listed.strip() == "[]"


async def _run(argv: list[str]) -> int:
    proc = await anyio.run_process(argv, check=False)
    return proc.returncode


async def _output(argv: list[str]) -> str:
    proc = await anyio.run_process(argv, check=True)
    return proc.stdout.decode()
