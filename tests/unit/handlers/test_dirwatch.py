"""The shared inotify instance (handlers._dirwatch): one for every watch, nothing lost, errors named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from daemon.core.handler import CallbackRequest
from handlers import FileWatch
from handlers._dirwatch import Changes, Subscription, _make, hub
from tests.helpers import REPO
from tests.helpers.probes import fds
from tests.helpers.support import runs_daemon_as_other_uid
from tests.helpers.wait import until

ADDED = 1


async def collect(sub: Subscription, into: Changes) -> None:
    """Gather every change of `sub` into `into` until cancelled."""
    while True:
        into |= await sub.next_batch()


class TestOneInstance:
    async def test_many_directories_share_one_instance(self, tmp_path: Path) -> None:
        """Thirty watches in thirty directories hold one inotify descriptor; it closes after."""
        await until(lambda: fds()["inotify"] == 0)  # earlier tests' instances are closed
        dirs = [tmp_path / f"d{n}" for n in range(30)]
        delivered: list[Any] = []

        async def listen(handler: FileWatch) -> None:
            req = CallbackRequest("wf", "main", "case", 1)
            req.setup_data = await handler.setup(req)

            async def deliver(value: Any) -> Any:
                delivered.append(value)
                return value

            await handler.listen(req, deliver)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for d in dirs:
                    d.mkdir()
                    tg.start_soon(listen, FileWatch(d / "f", on="created"))
                await until(lambda: hub().subscribers() == 30)
                await until(lambda: fds()["inotify"] == 1)  # a replaced one closes at once
                for d in dirs:
                    (d / "f").touch()
        assert sorted(v["path"] for v in delivered) == sorted(str(d / "f") for d in dirs)
        await until(lambda: fds()["inotify"] == 0)  # nobody watches: the instance is given back

    async def test_nothing_is_lost_while_the_instance_is_replaced(self, tmp_path: Path) -> None:
        """Files made while new directories keep replacing the instance are all seen."""
        watched = tmp_path / "w"
        watched.mkdir()
        seen: Changes = set()
        names = [watched / f"f{n}" for n in range(60)]
        shared = hub()
        with anyio.fail_after(30):
            async with shared.watching(str(watched)) as sub, anyio.create_task_group() as tg:
                tg.start_soon(collect, sub, seen)
                for n, name in enumerate(names):
                    name.touch()
                    if n % 3 == 0:  # a directory more: a new instance takes over
                        extra = tmp_path / f"x{n}"
                        extra.mkdir()
                        async with shared.watching(str(extra)):
                            await anyio.lowlevel.checkpoint()
                await until(lambda: {(ADDED, str(n)) for n in names} <= seen)
                tg.cancel_scope.cancel()

    async def test_a_directory_made_again_is_watched_anew(self, tmp_path: Path) -> None:
        """A watched directory removed and made again is seen as gone, and watched afresh."""
        d = tmp_path / "d"
        d.mkdir()
        shared = hub()
        async with shared.watching(str(d)) as sub:
            d.rmdir()
            with anyio.fail_after(10):
                while (3, str(d)) not in await sub.next_batch():
                    pass
            assert not shared.watched(str(d))
        d.mkdir()
        seen: Changes = set()
        with anyio.fail_after(10):
            async with shared.watching(str(d)) as sub, anyio.create_task_group() as tg:
                assert shared.watched(str(d))
                tg.start_soon(collect, sub, seen)
                (d / "f").touch()
                await until(lambda: (ADDED, str(d / "f")) in seen)
                tg.cancel_scope.cancel()


class TestErrors:
    def test_a_vanished_directory_is_left_out(self, tmp_path: Path) -> None:
        """A directory gone by the time the instance is built is left out, with its error."""
        here = tmp_path / "here"
        here.mkdir()
        target = {str(here), str(tmp_path / "gone")}
        built, dirs, errors = _make(target, {str(tmp_path / "gone")})
        assert built is not None
        built.close()
        assert dirs == {str(here)} and list(errors) == [str(tmp_path / "gone")]
        assert isinstance(errors[str(tmp_path / "gone")], FileNotFoundError)

    @runs_daemon_as_other_uid
    def test_limit_and_refused_directory_as_another_user(self, short_tmp: Path) -> None:
        """As uid 64999: with its inotify instances used up, setup raises the limit; a
        directory it may not read fails alone while the others are still watched."""
        os.chmod(short_tmp, 0o755)
        for name in ("a", "b"):
            (short_tmp / name).mkdir()
            os.chown(short_tmp / name, 64999, 64999)
        (short_tmp / "locked").mkdir(mode=0o700)  # root's: uid 64999 may not read it
        drop = ["setpriv", "--reuid", "64999", "--regid", "64999", "--clear-groups"]
        done = subprocess.run(
            [*drop, sys.executable, "-c", CHILD, str(short_tmp)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
        assert done.returncode == 0, done.stderr
        lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
        assert "max_user_instances" in lines["exhausted"], lines
        assert "Too many open files" in lines["exhausted"]
        assert lines["locked"].startswith(f"cannot watch {short_tmp / 'locked'}: Permission denied")
        assert lines["others"] == "True True"
        assert lines["after"] == "fired"


#: Runs as another uid (its own inotify instance count): exhausts it, then checks the errors.
CHILD = """
import ctypes, os, sys
import anyio
from daemon.core.handler import CallbackRequest
from handlers import FileWatch
from handlers._dirwatch import WatchFailed, hub

base = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)

async def main():
    req = CallbackRequest("wf", "main", "case", 1)
    hog = []
    while (fd := libc.inotify_init1(os.O_CLOEXEC)) >= 0:
        hog.append(fd)
    try:
        await FileWatch(f"{base}/a/f").setup(req)
        print("exhausted: no error")
    except WatchFailed as e:
        print(f"exhausted: {e}")
    for fd in hog:
        os.close(fd)
    shared = hub()
    async with shared.watching(f"{base}/a"), shared.watching(f"{base}/b") as b:
        try:
            await FileWatch(f"{base}/locked/f").setup(req)
            print("locked: no error")
        except WatchFailed as e:
            print(f"locked: {e}")
        print(f"others: {shared.watched(base + '/a')} {shared.watched(base + '/b')}")
        open(f"{base}/b/f", "w").close()
        with anyio.fail_after(10):
            while (1, f"{base}/b/f") not in await b.next_batch():
                pass
        print("after: fired")

anyio.run(main)
"""
