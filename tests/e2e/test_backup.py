"""`backup` end to end: a consistent copy, written only into `[store] backup_dir`, kept few."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon import State
from tests.helpers.disk import small_disk
from tests.helpers.harness import REPO, running_daemon
from tests.helpers.wait import settled, shown_when
from tests.workflows.e2e import Turnstile

MODULES = ["tests.workflows.e2e"]


async def workflowctl(sock: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run workflowctl against `sock` and return the finished process."""
    argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(sock), *args]
    with anyio.fail_after(60):
        return await anyio.run_process(argv, cwd=REPO, check=False)


def mode(path: Path) -> int:
    """Return a file's permission bits (of the link itself, for a link)."""
    return os.lstat(path).st_mode & 0o7777


def listing(folder: Path) -> list[str]:
    """Return the names in `folder`, sorted (empty if it does not exist)."""
    return sorted(os.listdir(folder)) if folder.exists() else []


class TestBackup:
    async def test_backup_is_a_consistent_copy(self, tmp_path: Path) -> None:
        """`workflowctl backup NAME` writes NAME.db, complete and private, beside the database."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            for n in range(20):
                await c.call("start", workflow="Turnstile", workflow_id=f"g{n}")
            # The copy is taken while the workflows' 0.2 s ticker timers fire, so it is no
            # snapshot of one status: what must hold is that every row is whole (below).
            done = await workflowctl(d.socket, "backup", "copy")
            assert done.returncode == 0, done.stderr
            dest = tmp_path / "backups" / "copy.db"
            assert f"backed up to {dest}".encode() in done.stdout
            again = await workflowctl(d.socket, "backup", "copy.db")  # the same file
            assert again.returncode == 1 and b"conflict" in again.stderr
            # Quiet once every ticker fired: then all 20 wait for signals, and nothing moves.
            for n in range(20):
                await shown_when(
                    c, f"g{n}", lambda s: s["status"] == "Waiting" and s["data"]["ticked"]
                )
            await settled(c)
            assert (await c.call("ping"))["workflows"] == {"Waiting": 20}
        assert listing(dest.parent) == ["copy.db"]  # no temporary file left
        assert (mode(dest.parent), mode(dest)) == (0o700, 0o600)
        db = sqlite3.connect(dest)
        try:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            rows = db.execute("SELECT id, name, status, data, state FROM workflows").fetchall()
            # History rows and their counter are written in one transaction with the state.
            torn = db.execute(
                "SELECT id FROM workflows w WHERE history_seq !="
                " (SELECT COALESCE(MAX(seq), 0) FROM history h WHERE h.workflow_id = w.id)"
            ).fetchall()
        finally:
            db.close()
        assert sorted(wid for wid, *_ in rows) == sorted(f"g{n}" for n in range(20))
        assert torn == []
        for wid, name, status, data, state in rows:
            assert name == "Turnstile"
            wf, st = Turnstile.from_json(data), State.from_json(state)  # each row decodes whole
            assert st.id == wid and st.status == status  # the status column matches its state
            assert status in ("Resuming", "Waiting")  # no signal was sent: it cannot have ended
            assert wf.got == []

    @pytest.mark.parametrize(
        "fields",
        [
            {"name": "../wd"},
            {"name": "sub/x"},
            {"name": "/etc/x"},
            {"name": "a..b"},
            {"name": ".hidden"},
            {"name": ""},
            {"name": "bad\x1b[2Jname"},
            {"name": "tab\there"},
            {"name": "x" * 201},
            {"path": "/tmp/x.db"},  # the old request: refused, naming the field to use
            {"name": "ok", "path": "/tmp/x.db"},
            {},
        ],
    )
    async def test_only_plain_names(self, tmp_path: Path, fields: dict[str, Any]) -> None:
        """A name that is no plain file name, or a `path`, is bad_request and writes nothing."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            response = await c.request("backup", **fields)
            assert (await c.call("ping"))["workflows"] == {}  # still serving
        assert response["ok"] is False, response
        assert response["error"]["code"] == "bad_request"
        assert "`name`" in response["error"]["message"]
        assert listing(tmp_path / "backups") == []
        assert [n for n in listing(tmp_path) if n.endswith(".db")] == ["wd.db"]

    async def test_keeps_the_newest(self, tmp_path: Path) -> None:
        """With backup_keep = 2 the oldest backup goes; other files and links are left alone."""
        folder = tmp_path / "kept"
        folder.mkdir(mode=0o700)
        (folder / "notes.txt").write_text("mine")
        (folder / "link.db").symlink_to(tmp_path / "wd.db")
        store = {"backup_dir": str(folder), "backup_keep": 2}
        async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
            results = [await c.call("backup", name=n) for n in ("mon", "tue", "wed")]
            thu = await workflowctl(d.socket, "backup", "thu")
        assert [r["deleted"] for r in results] == [[], [], ["mon.db"]]
        assert [r["path"] for r in results] == [
            str(folder / f"{n}.db") for n in ("mon", "tue", "wed")
        ]
        assert thu.returncode == 0 and b"; deleted the oldest: tue.db" in thu.stdout, thu
        assert listing(folder) == ["link.db", "notes.txt", "thu.db", "wed.db"]
        assert (folder / "link.db").is_symlink() and (tmp_path / "wd.db").exists()

    async def test_refused_when_the_disk_would_fill(self, tmp_path: Path) -> None:
        """A backup that would leave less than min_free_bytes free is `unavailable`, unwritten."""
        store = {"min_free_bytes": 1 << 62}
        async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
            response = await c.request("backup", name="big")
            assert (await c.call("ping"))["workflows"] == {}
        assert response["error"]["code"] == "unavailable", response
        assert "min_free_bytes" in response["error"]["message"]
        assert listing(tmp_path / "backups") == []

    async def test_small_disk_keeps_room_for_the_daemon(self, tmp_path: Path) -> None:
        """On a 16 MiB disk the default 64 MiB reserve refuses every backup; the daemon writes on."""
        async with small_disk(tmp_path / "disk") as disk:
            store = {"path": str(disk / "wd.db")}
            async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
                refused = [await c.request("backup", name=f"b{n}") for n in range(12)]
                started = await c.call("start", workflow="Turnstile", workflow_id="after")
                backups = listing(disk / "backups")
        assert {r["error"]["code"] for r in refused} == {"unavailable"}
        assert started["created"] is True and backups == []

    async def test_planted_link_is_not_followed(self, tmp_path: Path) -> None:
        """A link at the backup's name is `conflict`: the file it points to is not replaced."""
        folder, target = tmp_path / "bk", tmp_path / "victim.db"
        folder.mkdir(mode=0o700)
        target.write_bytes(b"precious")
        (folder / "evil.db").symlink_to(target)
        (folder / "gone.db").symlink_to(tmp_path / "nowhere" / "x.db")  # a dangling one
        store = {"backup_dir": str(folder)}
        async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
            evil = await c.request("backup", name="evil")
            gone = await c.request("backup", name="gone")
        assert evil["error"]["code"] == gone["error"]["code"] == "conflict"
        assert evil["error"]["message"] == f"{folder / 'evil.db'} exists; pick a new name"
        assert target.read_bytes() == b"precious"
        assert not (tmp_path / "nowhere").exists()
        assert listing(folder) == ["evil.db", "gone.db"]  # no temporary file left either

    @pytest.mark.parametrize("kind", ["open to all", "a link", "not ours"])
    async def test_unsafe_folder_is_refused(self, tmp_path: Path, kind: str) -> None:
        """A backup_dir others could write to, a link, or another uid's: refused, unwritten."""
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        folder = real
        if kind == "open to all":
            os.chmod(real, 0o777)
        elif kind == "a link":
            folder = tmp_path / "via"
            folder.symlink_to(real)
        elif os.geteuid() == 0:
            os.chown(real, 65534, 65534)
        else:
            pytest.skip("needs root to give the folder to another uid")
        store = {"backup_dir": str(folder)}
        async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
            response = await c.request("backup", name="x")
        assert response["error"]["code"] == "unavailable", response
        assert str(folder) in response["error"]["message"]
        assert listing(real) == []
