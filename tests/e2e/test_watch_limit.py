"""File watches at the inotify limits: a watch that cannot be set up says so and is retried.

The daemon runs as a uid of its own (64999), so using up that uid's inotify instances
(fs.inotify.max_user_instances counts per uid) disturbs nothing else on the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from tests.helpers import REPO
from tests.helpers.harness import Daemon, write_config
from tests.helpers.probes import fds
from tests.helpers.support import runs_daemon_as_other_uid
from tests.helpers.wait import logged, shown_when, until, wait_status

MODULES = ["tests.workflows.handler"]
UID = 64999
AS_UID = ["setpriv", "--reuid", str(UID), "--regid", str(UID), "--clear-groups"]

#: Opens inotify instances until the uid has none left, says how many, and holds them
#: until its stdin closes.
HOG = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
held = []
while (fd := libc.inotify_init1(os.O_CLOEXEC)) >= 0:
    held.append(fd)
print(f"holding {len(held)}", flush=True)
sys.stdin.read()
"""


class DaemonAs(Daemon):
    """A workflowd run as UID."""

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process as UID without waiting for it to be ready."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*AS_UID, sys.executable, "-m", "daemon.main", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env | {"PYTHONPATH": str(REPO)},
                cwd=self.tmp,
            )
        return self.proc


def wait_of(shown: dict[str, Any], event: str) -> dict[str, Any]:
    """Return the wait event `event` of a shown workflow (or {} if it has none)."""
    for thread in shown["state"]["threads"]:
        for ev in thread["wait_events"]:
            if ev["req"]["name"] == event:
                found: dict[str, Any] = ev
                return found
    return {}


@runs_daemon_as_other_uid
class TestInstanceLimit:
    async def test_watches_past_the_limit_are_setup_errors_then_fire(self, short_tmp: Path) -> None:
        """With the uid's inotify instances used up, every new watch is a setup error: shown,
        logged, retried. Once instances are free they all set up, share one, and fire."""
        os.chmod(short_tmp, 0o755)
        os.chown(short_tmp, UID, UID)  # the daemon's state and socket live here
        files = short_tmp / "files"
        targets = [files / f"d{n}" / "x" for n in range(40)]
        for t in targets:
            t.parent.mkdir(parents=True)
        d = DaemonAs(short_tmp, write_config(short_tmp, MODULES))
        hog: anyio.abc.Process | None = None
        try:
            await d.start()
            assert d.proc is not None
            pid = d.proc.pid
            hog = await anyio.open_process([*AS_UID, sys.executable, "-c", HOG])
            assert hog.stdout is not None and hog.stdin is not None
            with anyio.fail_after(30):
                said = await hog.stdout.receive()
            assert said.startswith(b"holding "), said
            async with d.client() as c:
                for n, t in enumerate(targets):
                    watch = {"kind": "file", "path": str(t), "on": "created"}
                    await c.call("start", workflow="Guarded", workflow_id=f"w{n}", input=watch)
                for n in range(len(targets)):
                    shown = await shown_when(
                        c, f"w{n}", lambda s: wait_of(s, "it").get("status") == "SetupError"
                    )
                    assert "max_user_instances" in wait_of(shown, "it")["error"], shown
                    assert "Too many open files" in wait_of(shown, "it")["error"]
                (failed, *_) = await logged(d, "handler_failed")
                assert "max_user_instances" in failed["error"]

                await hog.stdin.aclose()  # the instances are free again
                with anyio.fail_after(30):
                    await hog.wait()
                for n in range(len(targets)):
                    await shown_when(
                        c, f"w{n}", lambda s: wait_of(s, "it").get("status") == "Setup"
                    )
                # Forty watches, one inotify instance (a replaced one closes at once).
                await until(lambda: fds(pid)["inotify"] == 1)
                for t in targets:
                    t.touch()
                for n, t in enumerate(targets):
                    shown = await wait_status(c, f"w{n}", "Finished")
                    assert shown["data"]["ran"] == ["it"]
                    assert shown["data"]["seen"]["got"] == {"path": str(t), "change": "created"}
        finally:
            if hog is not None and hog.returncode is None:
                hog.kill()
                await hog.wait()
            if d.proc is not None and d.proc.poll() is None:
                await d.stop()

    async def test_watch_rearmed_past_the_limit_is_a_setup_error_then_fires(
        self, short_tmp: Path
    ) -> None:
        """A watch set up before a restart and re-armed after it, with the uid's inotify
        instances used up, is a setup error too: shown, logged, retried, then it fires.

        `early`'s file is created while its wait is in error: the retried setup keeps what
        the first one saw, so that edge fires too.
        """
        os.chmod(short_tmp, 0o755)
        os.chown(short_tmp, UID, UID)
        files = short_tmp / "files"
        files.mkdir()
        targets = {"late": files / "late", "early": files / "early"}
        d = DaemonAs(short_tmp, write_config(short_tmp, MODULES))
        hog: anyio.abc.Process | None = None
        try:
            await d.start()
            async with d.client() as c:
                for wid, t in targets.items():
                    watch = {"kind": "file", "path": str(t), "on": "created"}
                    await c.call("start", workflow="Guarded", workflow_id=wid, input=watch)
                for wid in targets:
                    await shown_when(c, wid, lambda s: wait_of(s, "it").get("status") == "Setup")
            assert await d.stop() == 0
            hog = await anyio.open_process([*AS_UID, sys.executable, "-c", HOG])
            assert hog.stdout is not None and hog.stdin is not None
            with anyio.fail_after(30):
                said = await hog.stdout.receive()
            assert said.startswith(b"holding "), said
            await d.start()
            async with d.client() as c:
                for wid in targets:
                    shown = await shown_when(
                        c, wid, lambda s: wait_of(s, "it").get("status") == "SetupError"
                    )
                    assert "max_user_instances" in wait_of(shown, "it")["error"], shown
                    assert "max_user_instances" in shown["error"]
                    (failed, *_) = await logged(d, "handler_failed", workflow_id=wid)
                    assert "max_user_instances" in failed["error"]
                    assert failed["retry_in_s"] > 0
                targets["early"].touch()

                await hog.stdin.aclose()  # the instances are free again
                with anyio.fail_after(30):
                    await hog.wait()
                await shown_when(c, "late", lambda s: wait_of(s, "it").get("status") == "Setup")
                targets["late"].touch()
                for wid, t in targets.items():
                    shown = await wait_status(c, wid, "Finished")
                    assert shown["data"]["ran"] == ["it"]
                    assert shown["data"]["seen"]["got"] == {"path": str(t), "change": "created"}
        finally:
            if hog is not None and hog.returncode is None:
                hog.kill()
                await hog.wait()
            if d.proc is not None and d.proc.poll() is None:
                await d.stop()
