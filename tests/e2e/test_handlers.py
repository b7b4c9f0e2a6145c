"""Handlers inside a real `workflowd` process: each kind fires, losers are torn down, and
armed waits survive a restart and a SIGKILL. Files, inotify and sockets are real.

(tests/unit/runtime/test_arming.py checks the same promises in process, on a fake clock.)
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness import Daemon, running_daemon
from tests.helpers.probes import exchange, fds, unix_bound, unix_listening
from tests.helpers.support import needs_root
from tests.helpers.wait import shown_when, until, wait_status

MODULES = ["tests.workflows.handler"]


class TestInDaemon:
    """Handlers inside a real workflowd process."""

    async def test_timer_fires(self, tmp_path: Path) -> None:
        """A short timer fires on the real clock and the data records the delivered times."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Guarded", workflow_id="t", input=timer(0.05))
            shown = await wait_status(c, "t", "Finished")
            got = shown["data"]["seen"]["got"]
            assert shown["data"]["ran"] == ["it"] and got["fired_at"] >= got["deadline"]

    async def test_file_created_fires_and_watch_closes(self, tmp_path: Path) -> None:
        """Creating the file fires the case; the daemon's inotify descriptor is closed."""
        target = tmp_path / "drop" / "x.txt"
        target.parent.mkdir()
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            base = fds(pid(d))["inotify"]
            await c.call("start", workflow="Guarded", workflow_id="f", input=watch(target))
            await until(lambda: fds(pid(d))["inotify"] == base + 1)
            target.write_text("hi")
            shown = await wait_status(c, "f", "Finished")
            assert shown["data"]["seen"]["got"] == {"path": str(target), "change": "created"}
            await until(lambda: fds(pid(d))["inotify"] == base)

    async def test_socket_fires_and_replies(self, tmp_path: Path) -> None:
        """A client's line fires the case and gets the output back; the socket file goes."""
        sock = tmp_path / "in.sock"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Guarded", workflow_id="s", input=listen(sock))
            await until(lambda: unix_listening(sock))
            assert await exchange(sock, line=b'{"n": 1}') == {"ok": True, "result": {"n": 1}}
            assert (await wait_status(c, "s", "Finished"))["data"]["ran"] == ["it"]
            await until(lambda: not sock.exists() and not unix_bound(sock))

    async def test_signal_fires(self, tmp_path: Path) -> None:
        """A signal sent over the control socket fires the case and its reply comes back."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Guarded", workflow_id="g", input={"kind": "signal"})
            assert await c.call("send", workflow_id="g", event="it", input=3) == {"echo": 3}
            assert (await wait_status(c, "g", "Finished"))["data"]["ran"] == ["it"]

    async def test_losers_torn_down(self, tmp_path: Path) -> None:
        """When stop wins, the daemon's inotify fd, listener and socket file are all gone.

        (A disarmed timer leaves nothing a client can see; TestTimer checks `rt.arms`.)
        """
        sock, target = tmp_path / "in.sock", tmp_path / "x"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            assert (await c.request("ping"))["ok"]  # our connection is accepted: count it in base
            base = fds(pid(d))
            await c.call("start", workflow="Guarded", workflow_id="f", input=watch(target))
            await c.call("start", workflow="Guarded", workflow_id="s", input=listen(sock))
            await until(
                lambda: unix_listening(sock) and fds(pid(d))["inotify"] == base["inotify"] + 1
            )
            for wid in "fs":
                assert (
                    await c.call("send", workflow_id=wid, event="stop", input=wid)
                    == f"stopped: {wid}"
                )
                assert (await wait_status(c, wid, "Finished"))["data"]["ran"] == ["stop"]
            await until(lambda: fds(pid(d)) == base)  # the inotify fd and the listener closed
            assert not sock.exists() and not unix_bound(sock)

    @pytest.mark.sqlite_only("reads the SQLite file")
    async def test_restart(self, tmp_path: Path) -> None:
        """After a restart: the overdue timer and the true `exists` fire, the socket reopens."""
        sock, flag = tmp_path / "in.sock", tmp_path / "flag"
        async with running_daemon(tmp_path, MODULES) as d:
            async with d.client() as c:
                await c.call("start", workflow="Guarded", workflow_id="t", input=timer(1.0))
                await c.call("start", workflow="Guarded", workflow_id="f", input=exists(flag))
                await c.call("start", workflow="Guarded", workflow_id="s", input=listen(sock))
                await until(lambda: unix_listening(sock))
                await wait_status(c, "t", "Waiting")
                deadline = setup_deadline(await c.call("show", workflow_id="t"))
            assert await d.stop() == 0
            assert not sock.exists()
            assert stored_status(tmp_path, "t") == "Waiting"  # it did not fire before the stop
            flag.touch()
            await until(lambda: time.time() > deadline + 0.05)
            await d.start()
            async with d.client() as c:
                shown = await wait_status(c, "t", "Finished")
                assert shown["data"]["seen"]["got"]["deadline"] == deadline
                shown = await wait_status(c, "f", "Finished")
                assert shown["data"]["seen"]["got"] == {"path": str(flag), "change": "exists"}
                await until(lambda: unix_listening(sock))
                assert await exchange(sock, line=b"again") == {"ok": True, "result": "again"}
                await wait_status(c, "s", "Finished")

    async def test_socket_reopened_after_sigkill(self, tmp_path: Path) -> None:
        """A socket file left by a crash is replaced by the restarted daemon's listener."""
        sock = tmp_path / "in.sock"
        async with running_daemon(tmp_path, MODULES) as d:
            async with d.client() as c:
                await c.call("start", workflow="Guarded", workflow_id="s", input=listen(sock))
                await until(lambda: unix_listening(sock))
            await d.kill()
            assert sock.exists() and not unix_bound(sock)
            await d.start()
            await until(lambda: unix_listening(sock))
            assert await exchange(sock, line=b"1") == {"ok": True, "result": 1}
            async with d.client() as c:
                await wait_status(c, "s", "Finished")


class TestForeignFiles:
    """A SocketListen path may be a client's choice: it takes over no file it did not make."""

    @needs_root
    async def test_stale_socket_of_another_uid_is_left_alone(self, tmp_path: Path) -> None:
        """Another uid's stale socket at the path: the wait fails clearly, the file stays."""
        sock = tmp_path / "other.sock"
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(sock))
        stale.close()  # no listener: a stale socket, as a crashed service leaves it
        os.chown(sock, 65534, 65534)
        before = os.lstat(sock)
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Guarded", workflow_id="s", input=listen(sock))
            shown = await shown_when(
                c, "s", lambda s: wait_of(s, "it").get("status") == "SetupError"
            )
            assert "socket of uid 65534" in wait_of(shown, "it")["error"]
            assert await c.call("send", workflow_id="s", event="stop", input="x") == "stopped: x"
        after = os.lstat(sock)
        assert stat.S_ISSOCK(after.st_mode) and after.st_uid == 65534
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    async def test_regular_file_is_left_alone(self, tmp_path: Path) -> None:
        """A regular file at the path: the wait fails saying so, the file keeps its content."""
        path = tmp_path / "data.db"
        path.write_bytes(b"precious")
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Guarded", workflow_id="f", input=listen(path))
            shown = await shown_when(
                c, "f", lambda s: wait_of(s, "it").get("status") == "SetupError"
            )
            assert "not a socket" in wait_of(shown, "it")["error"]
        assert path.read_bytes() == b"precious"


def wait_of(shown: dict[str, Any], name: str) -> dict[str, Any]:
    """Return a shown workflow's wait event `name` (an empty dict while it is not armed)."""
    events = [ev for t in shown["state"]["threads"] for ev in t["wait_events"]]
    found: dict[str, Any] = next((ev for ev in events if ev["req"]["name"] == name), {})
    return found


def pid(d: Daemon) -> int:
    """Return the daemon's process id."""
    assert d.proc is not None
    return d.proc.pid


def timer(after: float) -> dict[str, Any]:
    """Input for a Guarded timer case."""
    return {"kind": "timer", "after": after}


def watch(path: Path) -> dict[str, Any]:
    """Input for a Guarded FileWatch(created) case."""
    return {"kind": "file", "path": str(path)}


def exists(path: Path) -> dict[str, Any]:
    """Input for a Guarded FileWatch(exists) case."""
    return {"kind": "file", "path": str(path), "on": "exists"}


def listen(path: Path) -> dict[str, Any]:
    """Input for a Guarded SocketListen(path) case."""
    return {"kind": "socket", "path": str(path)}


def setup_deadline(shown: dict[str, Any]) -> float:
    """Return the deadline the timer case stored at setup."""
    events = [ev for t in shown["state"]["threads"] for ev in t["wait_events"]]
    (req,) = [ev["req"] for ev in events if ev["req"]["name"] == "it"]
    return float(json.loads(req["setup_data"])["deadline"])


def stored_status(tmp: Path, wid: str) -> str:
    """Read a workflow's status straight from the stopped daemon's database."""
    with sqlite3.connect(tmp / "wd.db") as conn:
        (status,) = conn.execute("SELECT status FROM workflows WHERE id = ?", (wid,)).fetchone()
    return str(status)
