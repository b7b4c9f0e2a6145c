"""workflowd as a systemd service: sd_notify, reload and socket activation, end to end."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from tests.helpers.client import Client, connect
from tests.helpers.harness import REPO, Daemon, running_daemon, write_config
from tests.helpers.wait import settled, wait_status
from tests.workflows import service as versions

MODULE = "svc_flows"  # written into each test's tmp_path, so every test has its own copy


class NotifySocket:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET; keeps every message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.seen: list[str] = []

    def env(self, **extra: str) -> dict[str, str]:
        """Return the environment that points a daemon at this socket."""
        return {"NOTIFY_SOCKET": str(self.path), **extra}

    async def expect(self, match: Callable[[str], bool], limit_s: float = 20) -> str:
        """Receive (bounded) until a message matches; return it."""
        with anyio.fail_after(limit_s):
            while True:
                await anyio.wait_readable(self.sock)
                message = self.sock.recv(4096).decode()
                self.seen.append(message)
                if match(message):
                    return message

    def close(self) -> None:
        self.sock.close()


def is_(text: str) -> Callable[[str], bool]:
    return lambda m: m == text


def config_sections(tmp: Path, **extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Config sections that import the test's own copy of the workflow module."""
    return {"workflows": {"paths": [str(REPO), str(tmp)]}, **extra}


async def workflowctl(sock: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run workflowctl against `sock` and return the finished process."""
    argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(sock), *args]
    return await anyio.run_process(argv, cwd=REPO, check=False)


async def wait_running(c: Client, workflow_id: str) -> None:
    """Poll `show` (bounded) until the workflow is running a step."""
    with anyio.fail_after(20):
        while True:
            if "running_step" in await c.call("show", workflow_id=workflow_id):
                return
            await anyio.sleep(0.02)


class TestNotify:
    async def test_ready_only_after_recovery_and_listening(self, tmp_path: Path) -> None:
        """READY=1 comes after `recovered` is logged and once the control socket answers."""
        versions.write(tmp_path, MODULE, versions.V1, "v1")
        sections = config_sections(tmp_path)
        async with running_daemon(tmp_path, [MODULE], **sections) as d, d.client() as c:
            for n in range(30):
                await c.call("start", workflow="Gate", workflow_id=f"g{n}")
            for n in range(30):  # each started asynchronously: wait for all, not the last one
                await wait_status(c, f"g{n}", "Waiting")
        notify = NotifySocket(tmp_path / "notify.sock")
        d = Daemon(tmp_path, write_config(tmp_path, [MODULE], **sections), notify.env())
        d.log = tmp_path / "second-run.log"  # only this run's records
        d.spawn()
        try:
            await notify.expect(is_("READY=1"))
            events = [r["event"] for r in d.records()]
            assert "recovered" in events and "control_listening" in events
            recovered = next(r for r in d.records() if r["event"] == "recovered")
            assert recovered["armed"] + recovered["resumed"] == 30
            async with d.client() as c:  # no retry: it must answer at once
                first = await c.call("ping")
                # Recovery has re-armed or resumed all 30; a resumed one may still be at work.
                assert sum(first["workflows"].values()) == 30
                assert set(first["workflows"]) <= {"Waiting", "Resuming"}
                await settled(c)
                assert (await c.call("ping"))["workflows"] == {"Waiting": 30}
            assert notify.seen == ["READY=1"]  # nothing else claimed readiness first
        finally:
            await d.stop()
            notify.close()

    async def test_status_watchdog_and_stopping(self, tmp_path: Path) -> None:
        """STATUS= follows the workflows, WATCHDOG=1 keeps coming, SIGTERM sends STOPPING=1."""
        versions.write(tmp_path, MODULE, versions.V1, "v1")
        notify = NotifySocket(tmp_path / "notify.sock")
        env = notify.env(WATCHDOG_USEC="200000")  # a ping every 0.1 s
        try:
            sections = config_sections(tmp_path)
            async with running_daemon(tmp_path, [MODULE], env, **sections) as d:
                await notify.expect(is_("READY=1"))
                await notify.expect(is_("STATUS=0 waiting, 0 running, 0 failed"))
                async with d.client() as c:
                    for n in range(3):
                        await c.call("start", workflow="Gate", workflow_id=f"g{n}")
                await notify.expect(is_("STATUS=3 waiting, 0 running, 0 failed"))
                before = notify.seen.count("WATCHDOG=1")
                for _ in range(5):
                    await notify.expect(is_("WATCHDOG=1"))
                assert notify.seen.count("WATCHDOG=1") >= before + 5
                assert await d.stop() == 0
            await notify.expect(is_("STOPPING=1"))
        finally:
            notify.close()

    async def test_sighup_sends_reloading_then_ready(self, tmp_path: Path) -> None:
        """SIGHUP sends RELOADING=1 with MONOTONIC_USEC, then READY=1 once done."""
        versions.write(tmp_path, MODULE, versions.V1, "v1")
        notify = NotifySocket(tmp_path / "notify.sock")
        try:
            sections = config_sections(tmp_path)
            async with running_daemon(tmp_path, [MODULE], notify.env(), **sections) as d:
                await notify.expect(is_("READY=1"))
                assert d.proc is not None
                d.proc.send_signal(signal.SIGHUP)
                reloading = await notify.expect(lambda m: m.startswith("RELOADING=1"))
                first, second = reloading.split("\n")
                assert first == "RELOADING=1" and second.startswith("MONOTONIC_USEC=")
                assert int(second.partition("=")[2]) > 0
                await notify.expect(is_("READY=1"))
                assert any(r["event"] == "reloaded" for r in d.records())
        finally:
            notify.close()


class TestReload:
    async def test_compatible_change_is_used(self, tmp_path: Path) -> None:
        """New step bodies and added steps take effect, even for a step running during the reload."""
        versions.write(tmp_path, MODULE, versions.V1, "v1")
        flag = tmp_path / "flag"
        sections = config_sections(tmp_path)
        async with running_daemon(tmp_path, [MODULE], **sections) as d, d.client() as c:
            await c.call("start", workflow="Gate", workflow_id="gate")
            await c.call("start", workflow="Busy", workflow_id="busy", input={"flag": str(flag)})
            await wait_status(c, "gate", "Waiting")
            await wait_running(c, "busy")
            versions.write(tmp_path, MODULE, versions.V2, "v2")
            done = await workflowctl(d.socket, "reload")
            assert done.returncode == 0, done.stderr
            assert b"reloaded" in done.stdout
            flag.touch()
            await c.call("send", workflow_id="gate", event="go")
            gate = await wait_status(c, "gate", "Finished")
            busy = await wait_status(c, "busy", "Finished")
        assert gate["data"]["done"] == ["after-v2", "extra-v2"]
        # The running step finished with the code it started with, then the new step ran.
        assert busy["data"]["done"] == ["hold-v1", "more-v2"]
        # The new code is linted as the code at start is (Gate's waits have no timeout).
        events = [(r["event"], r.get("code")) for r in d.records()]
        after = events[events.index(("reloaded", None)) :]
        assert ("lint_warning", "no_timeout") in after

    async def test_incompatible_change_is_refused(self, tmp_path: Path) -> None:
        """A renamed Wait and a removed Go block the reload, named in the log and by workflowctl."""
        versions.write(tmp_path, MODULE, versions.V1, "v1")
        sections = config_sections(tmp_path)
        async with running_daemon(tmp_path, [MODULE], **sections) as d, d.client() as c:
            await c.call("start", workflow="Gate", workflow_id="gate")
            await wait_status(c, "gate", "Waiting")
            versions.write(tmp_path, MODULE, versions.V3, "v3")
            refused = await workflowctl(d.socket, "reload")
            assert refused.returncode == 1
            out = refused.stdout.decode()
            assert "reload refused" in out and "gate (Gate)" in out
            assert "'gate' is gone" in out and "Go 'side' is gone" in out
            versions.write(tmp_path, MODULE, versions.BROKEN)
            broken = await workflowctl(d.socket, "--json", "reload")
            assert broken.returncode == 1
            assert "SyntaxError" in json.loads(broken.stdout)["error"]
            # Still the old code, with its own module globals (SUFFIX is still "v1").
            await c.call("send", workflow_id="gate", event="go")
            gate = await wait_status(c, "gate", "Finished")
        assert gate["data"]["done"] == ["after-v1"]
        logged = [r for r in d.records() if r["event"] == "reload_refused"]
        assert logged[0]["blocked"][0]["workflow_id"] == "gate"
        assert any("gate" in reason for reason in logged[0]["blocked"][0]["reasons"])
        by = [r for r in d.records() if r["event"] == "reload_blocked_by"]
        assert by[0]["workflow_id"] == "gate"

    async def test_settings_apply_live(self, tmp_path: Path) -> None:
        """A reload applies the log level and the control socket's limits without a restart."""
        versions.write(tmp_path, MODULE, versions.V1, "v1")
        sections = config_sections(tmp_path)
        async with running_daemon(tmp_path, [MODULE], **sections) as d, d.client() as c:
            write_config(
                tmp_path,
                [MODULE],
                **sections,
                log={"level": "warning"},
                daemon={"socket": str(d.socket), "max_request_bytes": 100},
            )
            result = await c.call("reload")
            assert result["reloaded"] and result["needs_restart"] == []
            await c.call("start", workflow="Gate", workflow_id="quiet")
            async with connect(d.socket) as big:
                response = await big.request("ping", pad="x" * 200)
            assert response["error"]["code"] == "too_large"
            await wait_status(c, "quiet", "Waiting")  # started asynchronously: it blocks soon
            assert (await c.call("ping"))["workflows"] == {"Waiting": 1}
        events = [r["event"] for r in d.records()]
        assert "reloaded" not in events  # logged at info, after the level went up
        assert "workflow_started" not in events

    async def test_workflowctl_without_daemon_exits_3(self, tmp_path: Path) -> None:
        """`workflowctl reload` with nobody listening exits 3."""
        done = await workflowctl(tmp_path / "none.sock", "reload")
        assert done.returncode == 3
        assert b"cannot reach workflowd" in done.stderr


# What systemd does between fork and exec: the socket goes to fd 3 and LISTEN_PID is our own pid.
SYSTEMD_EXEC = """
import os, sys
os.dup2(int(sys.argv[1]), 3)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="workflowd.sock")
os.execv(sys.executable, [sys.executable, "-m", "daemon.main", "--config", sys.argv[2]])
"""


class TestSocketActivation:
    async def test_daemon_serves_the_inherited_socket(self, tmp_path: Path) -> None:
        """Given a listening socket as fd 3 (LISTEN_FDS), workflowd serves it and binds nothing."""
        config = write_config(tmp_path, ["tests.workflows.e2e"])
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(tmp_path / "activated.sock"))
        sock.listen()
        fd = sock.fileno()
        argv = [sys.executable, "-c", SYSTEMD_EXEC, str(fd), str(config)]
        process = await anyio.open_process(argv, cwd=REPO, pass_fds=(fd,))
        sock.close()
        try:
            # systemd queues clients that connect before the daemon accepts; so does the kernel.
            async with connect(tmp_path / "activated.sock") as c:
                with anyio.fail_after(30):
                    assert (await c.call("ping"))["workflows"] == {}
                    await c.call("start", workflow="Turnstile", workflow_id="g")
            assert not (tmp_path / "wd.sock").exists()  # the config's own path stays unused
        finally:
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                assert await process.wait() == 0
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    await stream.aclose()
