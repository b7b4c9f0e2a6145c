"""The daemon's state on disk: private whatever the umask, and refused at start if unwritable."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

from tests.helpers import REPO
from tests.helpers.client import connect
from tests.helpers.harness import Daemon, write_config
from tests.helpers.support import runs_daemon_as_other_uid
from tests.helpers.wait import wait_status

MODULES = ["tests.workflows.stalls"]


def mode(path: Path) -> int:
    """Return a file's permission bits."""
    return path.stat().st_mode & 0o7777


async def start_under_umask(d: Daemon, mask: int) -> None:
    """Start the daemon with `mask` as its umask and wait (bounded) until it answers ping."""
    old = os.umask(mask)  # inherited by the child; set back before anything else runs here
    try:
        proc = d.spawn()
    finally:
        os.umask(old)
    with anyio.fail_after(30):
        while True:
            assert proc.poll() is None, d.output()
            try:
                async with connect(d.socket) as c:
                    if (await c.request("ping"))["ok"]:
                        return
            except OSError:
                pass
            await anyio.sleep(0.02)


async def run_to_exit(
    config: Path, cwd: Path, prefix: list[str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run workflowd (after `prefix`, e.g. setpriv) until it exits by itself (bounded)."""
    argv = [*(prefix or []), sys.executable, "-m", "daemon.main", "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with anyio.fail_after(30):
        return await anyio.run_process(argv, cwd=cwd, env=env, check=False)


@contextmanager
def immutable(path: Path) -> Iterator[None]:
    """Make `path` immutable (chattr +i; root is not exempt) for the block, or skip."""
    try:
        subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"chattr +i does not work on this file system: {e}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


class TestPrivate:
    """Outside systemd nothing sets the modes for us: the daemon does, whatever the umask."""

    @pytest.mark.parametrize("mask", [0o000, 0o022])
    async def test_state_folder_and_files(self, tmp_path: Path, mask: int) -> None:
        """The state folder it creates is 0700; the database, -wal, -shm, lock and backups 0600."""
        state = tmp_path / "state"
        config = write_config(tmp_path, MODULES, store={"path": str(state / "wd.db")})
        d = Daemon(tmp_path, config)
        await start_under_umask(d, mask)
        try:
            async with d.client() as c:
                wid = (await c.call("start", workflow="Quick"))["workflow_id"]
                await wait_status(c, wid, "Finished")
                await c.call("backup", name="copy")
                files = {p.name: mode(p) for p in state.iterdir() if p.name != "backups"}
        finally:
            await d.stop()
        assert mode(state) == mode(state / "backups") == 0o700
        assert set(files) == {"wd.db", "wd.db-wal", "wd.db-shm", "wd.db.lock"}
        assert files == dict.fromkeys(files, 0o600)
        assert mode(state / "backups" / "copy.db") == 0o600


class TestUnwritable:
    """A database the daemon cannot write stops the start: one line, exit 2, no READY."""

    async def test_immutable_database(self, tmp_path: Path) -> None:
        """chattr +i on the database (root is not exempt): refused, naming the file and errno."""
        config = write_config(tmp_path, MODULES)
        d = Daemon(tmp_path, config)
        await d.start()  # creates the database
        await d.stop()
        db = tmp_path / "wd.db"
        with immutable(db):
            done = await run_to_exit(config, tmp_path)
        assert done.returncode == 2, done
        assert done.stderr.decode().splitlines() == [
            f"workflowd: cannot write {db}: [Errno 1] Operation not permitted (EPERM)"
        ]
        assert b"daemon_started" not in done.stdout
        assert not (tmp_path / "wd.sock").exists()

    @runs_daemon_as_other_uid
    async def test_folder_another_user_cannot_write(self, short_tmp: Path) -> None:
        """Run as uid 65534 on a root-owned folder: refused, naming the file and EACCES."""
        os.chmod(short_tmp, 0o755)  # readable (the config), not writable, by uid 65534
        config = write_config(short_tmp, MODULES)
        drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        done = await run_to_exit(config, Path("/"), drop)
        assert done.returncode == 2, done
        lock = short_tmp / "wd.db.lock"
        assert done.stderr.decode().splitlines() == [
            f"workflowd: cannot write {lock}: [Errno 13] Permission denied (EACCES)"
        ]
        assert b"daemon_started" not in done.stdout
