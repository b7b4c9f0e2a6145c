"""The service as people run it: the README's --hold recipe, the unit's sandbox and account."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import socket as stdlib_socket
import sys
from pathlib import Path

import anyio
import pytest

from tests.helpers import REPO
from tests.helpers.client import connect
from tests.helpers.ctl import clean_env, ctl, ok
from tests.helpers.harness import running_daemon
from tests.helpers.wait import eventually, wait_status

README = (REPO / "README.md").read_text()
UNIT = (REPO / "systemd" / "workflowd.service").read_text()
ANALYZE = shutil.which("systemd-analyze")


def hold_recipe() -> list[str]:
    """Return the command lines of the README's `workflowd --hold` recipe."""
    section = README.split("### After a bad crash: `workflowd --hold`", 1)[1]
    block = section.split("```console\n", 1)[1].split("```", 1)[0]
    return [line.removeprefix("$ ") for line in block.splitlines() if line.startswith("$ ")]


class TestHoldRecipe:
    def test_stops_the_socket_unit_too(self) -> None:
        """The recipe stops workflowd.socket, so no client restarts the service meanwhile."""
        stop = [line for line in hold_recipe() if "systemctl stop" in line]
        assert stop and "workflowd.socket" in stop[0] and "workflowd.service" in stop[0]

    async def test_runs_as_written_in_a_temporary_folder(self, tmp_path: Path) -> None:
        """The recipe's workflowd line, its paths moved under tmp_path, starts held and answers."""
        (line,) = [line for line in hold_recipe() if "--hold" in line]
        run, state, etc = tmp_path / "run", tmp_path / "state", tmp_path / "etc"
        for folder in (run, state, etc / "workflows"):
            folder.mkdir(parents=True)
        shipped = (REPO / "systemd" / "config.toml").read_text()
        # The changes to the shipped config: this machine has no `workflowd` group, and the
        # shipped config loads no workflows (the recipe needs one to show it serves).
        for setting in ('socket_group = "workflowd"', "modules = []"):
            assert setting in shipped
        (etc / "config.toml").write_text(
            shipped.replace('allowed_groups = ["workflowd"]', "allowed_groups = []")
            .replace('socket_group = "workflowd"', "")
            .replace("modules = []", 'modules = ["daemon.examples"]')
        )
        moved = (
            line.replace("/opt/workflowd/venv/bin/", f"{Path(sys.executable).parent}/")
            .replace("/etc/workflowd/", f"{etc}/")
            .replace("/run/workflowd", str(run))
            .replace("/var/lib/workflowd", str(state))
        )
        argv = shlex.split(moved)
        assert argv[:3] == ["sudo", "-u", "workflowd"]  # we are not that user here: drop it
        argv = argv[3:]
        with stdlib_socket.socket(stdlib_socket.AF_UNIX) as stale:  # what the stopped unit left
            stale.bind(str(run / "workflowd.sock"))
        log = tmp_path / "daemon.log"
        with log.open("wb") as out:
            proc = await anyio.open_process(
                argv, cwd=tmp_path, env=clean_env(), stdout=out, stderr=out
            )
        socket = run / "workflowd.sock"
        try:

            async def answers() -> bool:
                if proc.returncode is not None:
                    return True  # exited: said why in its log
                try:
                    async with connect(socket) as c:
                        return bool((await c.request("ping"))["ok"])
                except OSError:  # not listening yet (the stale file is still there)
                    return False

            await eventually(answers, limit_s=30)
            assert proc.returncode is None, log.read_text()
            pinged = ok(await ctl("ping", socket=socket))
            started = ok(await ctl("start", "Approval", "--id", "a", socket=socket))
            assert (state / "workflowd.db").exists()
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                await proc.wait()
        assert proc.returncode == 0, log.read_text()
        assert pinged.startswith("workflowd ")
        assert started == "a: Resuming, held (`workflowctl resume a` lets it run)\n"


class TestUnit:
    def test_one_useradd(self) -> None:
        """The unit's comment and the README create the account with the same command."""
        unit = re.findall(r"useradd [^\n]*", UNIT)
        readme = re.findall(r"useradd [^\n`]*", README)
        assert unit and readme and set(unit) == set(readme), (unit, readme)

    @pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
    async def test_exposure_at_most_2(self) -> None:
        """`systemd-analyze security` rates the unit 2.0 or better."""
        assert ANALYZE is not None
        unit = str(REPO / "systemd" / "workflowd.service")
        done = await anyio.run_process(
            [ANALYZE, "security", "--offline=yes", "--no-pager", unit], check=False
        )
        text = done.stdout.decode()
        found = re.search(r"Overall exposure level for workflowd.service: (\d+\.\d)", text)
        if found is None:
            pytest.skip(f"systemd-analyze cannot rate units offline here: {done.stderr.decode()}")
        assert float(found.group(1)) <= 2.0, text
        for setting in ("PrivateDevices=", "ProtectClock=", "ProtectProc=", "RemoveIPC="):
            assert f"✗ {setting}" not in text


class TestCleanStop:
    async def test_no_abandoned_threads_after_a_sync_step(self, tmp_path: Path) -> None:
        """A clean stop after sync steps ran exits 0 without `daemon_exit_abandoning_threads`.

        The threads left (the database connection's, idle workers') end just after the event
        loop does, so the old check lost that race only most of the time: three stops.
        """
        for n in range(5):
            async with running_daemon(tmp_path, ["tests.workflows.ctl"]) as d:
                async with d.client() as c:
                    await c.call("start", workflow="Latch", workflow_id=f"l{n}")
                    await wait_status(c, f"l{n}", "Waiting")
                    await c.call("send", workflow_id=f"l{n}", event="open")  # a sync step runs
                    await wait_status(c, f"l{n}", "Finished")
                code = await d.stop()
            assert code == 0
        events = [r["event"] for r in d.records()]
        assert events.count("daemon_stopped") == 5
        assert "daemon_exit_abandoning_threads" not in events
