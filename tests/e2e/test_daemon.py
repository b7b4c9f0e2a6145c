"""End-to-end tests of the real `workflowd` process: start, signal, crash and restart."""

from __future__ import annotations

import collections
import os
import shutil
import socket
from pathlib import Path

import anyio
import pytest

from tests.helpers.harness import REPO, Daemon, run_workflowd, running_daemon, write_config
from tests.helpers.support import needs_root
from tests.helpers.wait import until, wait_status

MODULES = ["tests.workflows.e2e"]


class TestProcess:
    """The daemon process as operators run it."""

    async def test_start_signal_finish(self, tmp_path: Path) -> None:
        """A workflow started over the socket takes signals and finishes."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            res = await c.call("start", workflow="Turnstile", workflow_id="g1", input={"id": "g1"})
            assert res["workflow_id"] == "g1"
            for n in range(3):
                assert await c.call("send", workflow_id="g1", event="add", input=n) == n + 1
            shown = await wait_status(c, "g1", "Finished")
            assert shown["data"]["got"] == [0, 1, 2]
        assert d.proc is not None and d.proc.returncode == 0
        events = [r["event"] for r in d.records()]
        assert "daemon_started" in events and "daemon_stopping" in events

    async def test_sigkill_loses_nothing(self, tmp_path: Path) -> None:
        """After SIGKILL mid-run, every workflow resumes and no checkpointed step runs again."""
        steplog = tmp_path / "steps.log"
        env = {"E2E_STEP_LOG": str(steplog)}
        ids = [f"w{n}" for n in range(10)]
        async with running_daemon(tmp_path, MODULES, env=env) as d:
            async with d.client() as c:
                for wid in ids:
                    await c.call("start", workflow="Steps", workflow_id=wid, input={"id": wid})
            # Kill mid-run: once a tenth of the 200 steps ran (a real signal, not a sleep).
            await until(lambda: steplog.exists() and len(steplog.read_bytes().splitlines()) >= 20)
            await d.kill()
            await d.start()
            async with d.client() as c:
                for wid in ids:
                    shown = await wait_status(c, wid, "Finished")
                    assert shown["data"]["i"] == 20
        runs = collections.Counter(steplog.read_text().split("\n")[:-1])
        assert set(runs) == {f"{w} s{i} 0" for w in ids for i in range(20)}
        # At most one step per workflow was in flight at the kill, so ran twice.
        per_wf = collections.Counter(line.split()[0] for line, n in runs.items() if n > 1)
        assert all(n <= 1 for n in per_wf.values()), runs
        assert all(n <= 2 for n in runs.values())

    @pytest.mark.sqlite_only("on PostgreSQL a second daemon shares the work: e2e/test_postgres")
    async def test_second_daemon_refused(self, tmp_path: Path) -> None:
        """A second workflowd on the same database exits 1 with a clear message."""
        async with running_daemon(tmp_path, MODULES) as d:
            code, stderr = await run_workflowd(d.config, tmp_path)
            assert code == 1
            assert "another workflowd holds" in stderr
            async with d.client() as c:
                assert (await c.request("ping"))["ok"]

    async def test_socket_taken_by_another_daemon_exits_2(self, tmp_path: Path) -> None:
        """A daemon of another database on a live daemon's socket stops with one line, exit 2."""
        async with running_daemon(tmp_path, MODULES) as d:
            other = tmp_path / "other"
            other.mkdir()
            config = write_config(other, MODULES, daemon={"socket": str(d.socket)})
            code, stderr = await run_workflowd(config, other)
            assert code == 2, stderr
            assert "another workflowd is listening" in stderr
            assert len(stderr.strip().splitlines()) == 1, stderr
            async with d.client() as c:  # the live one keeps its socket
                assert (await c.request("ping"))["ok"]

    @needs_root
    async def test_stale_socket_of_another_uid_is_left_alone(self, tmp_path: Path) -> None:
        """Another uid's dead socket at the control socket's path: exit 2, the file stays."""
        path = tmp_path / "ctl.sock"
        with socket.socket(socket.AF_UNIX) as dead:
            dead.bind(str(path))
        os.chown(path, 65534, 65534)
        before = os.lstat(path)
        config = write_config(tmp_path, MODULES, daemon={"socket": str(path)})
        with anyio.fail_after(60):  # a daemon that took the socket over would run on
            code, stderr = await run_workflowd(config, tmp_path)
        assert code == 2, stderr
        assert "socket of uid 65534" in stderr
        after = os.lstat(path)
        assert (after.st_ino, after.st_uid) == (before.st_ino, 65534)

    async def test_bad_config_exits_2(self, tmp_path: Path) -> None:
        """A bad config stops the start with one clear line naming the key, exit code 2."""
        config = write_config(tmp_path, MODULES, runtime={"retry_initial_s": "soon"})
        code, stderr = await run_workflowd(config)
        assert code == 2
        assert "retry_initial_s" in stderr
        assert len(stderr.strip().splitlines()) == 1

    async def test_unknown_module_exits_2(self, tmp_path: Path) -> None:
        """A module that cannot be imported is named in the one-line error."""
        config = write_config(tmp_path, ["no_such_module_here"])
        code, stderr = await run_workflowd(config)
        assert code == 2
        assert "no_such_module_here" in stderr

    async def test_default_config_runs(self, short_tmp: Path) -> None:
        """The repository's config.toml (examples, ./state) starts as the README says.

        It runs on a verbatim copy in a temporary folder: relative paths resolve against the
        config file's folder, so its ./state is the copy's, never the checkout's, and a
        developer's daemon running from the checkout neither is disturbed nor makes this pass.
        (A short folder: the socket path is limited to 107 bytes.)
        """
        config = short_tmp / "config.toml"
        shutil.copyfile(REPO / "config.toml", config)
        d = Daemon(short_tmp, config)
        d.socket = short_tmp / "state" / "workflowd.sock"
        await d.start()
        try:
            async with d.client() as c:
                res = await c.call("start", workflow="Approval", input={"request": "e2e"})
                out = await c.call(
                    "send",
                    workflow_id=res["workflow_id"],
                    event="decide",
                    input={"approve": True, "by": "test"},
                )
                assert out == "e2e approved by test"
                # Approved, it carries out and ends (a cancel now would race that end).
                await wait_status(c, res["workflow_id"], "Finished")
        finally:
            assert await d.stop() == 0
        assert (short_tmp / "state" / "workflowd.db").exists()  # the state went to the copy
