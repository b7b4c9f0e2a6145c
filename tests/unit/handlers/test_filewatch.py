"""FileWatch driven directly: setup, listen with a real deliver, teardown; real files and inotify."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon.core.handler import ActiveHandler, CallbackRequest
from handlers import FileWatch
from handlers._dirwatch import hub


class Inbox:
    """A deliver coroutine that records every input and returns it."""

    def __init__(self) -> None:
        self.inputs: list[Any] = []
        self.event = anyio.Event()

    async def __call__(self, input: Any) -> Any:
        self.inputs.append(input)
        self.event.set()
        return input


def inotify_fds() -> int:
    """Count this process's open inotify file descriptors."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                count += 1
        except OSError:
            pass
    return count


async def until(cond: Any, ceiling: float = 10.0) -> None:
    """Poll `cond()` until it is true, failing after `ceiling` seconds."""
    with anyio.fail_after(ceiling):
        while not cond():  # noqa: ASYNC110 - /proc and files have no event to wait on
            await anyio.sleep(0.01)


async def fire(handler: FileWatch, req: CallbackRequest, act: Any = None) -> Any:
    """Run listen; once it watches its directory, call `act()`; return the delivered input."""
    inbox = Inbox()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(handler.listen, req, inbox)
            if act is not None:
                await until(lambda: hub().subscribers() > 0 or inbox.inputs)
                act()
            await inbox.event.wait()
    assert hub().subscribers() == 0  # the subscription ends with listen
    assert len(inbox.inputs) == 1
    return inbox.inputs[0]


async def setup(handler: FileWatch) -> CallbackRequest:
    """Run setup and return a request carrying its setup data."""
    req = CallbackRequest("wf", "main", "case", 1)
    req.setup_data = await handler.setup(req)
    return req


class TestConstruction:
    def test_is_active_handler(self) -> None:
        """FileWatch satisfies the ActiveHandler protocol."""
        assert isinstance(FileWatch("x"), ActiveHandler)
        assert FileWatch("x").type == "file"

    def test_rejects_unknown_condition(self) -> None:
        """An unknown `on` is refused at construction."""
        with pytest.raises(ValueError, match="on="):
            FileWatch("x", on="renamed")

    def test_glob_only_for_exists(self) -> None:
        """A glob is refused for every condition but exists, and outside the last component."""
        with pytest.raises(ValueError, match="glob"):
            FileWatch("/tmp/*.csv", on="created")
        with pytest.raises(ValueError, match="last path component"):
            FileWatch("/tmp/*/x.csv", on="exists")
        FileWatch("/tmp/*.csv", on="exists")

    async def test_relative_path_stored_absolute(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Setup resolves a relative path against the working directory."""
        monkeypatch.chdir(tmp_path)
        req = await setup(FileWatch("sub/f.txt"))
        assert f'"path":"{tmp_path}/sub/f.txt"' in req.setup_data


class TestFire:
    async def test_created(self, tmp_path: Path) -> None:
        """Creating the file fires `created` through inotify."""
        target = tmp_path / "f.txt"
        handler = FileWatch(target)
        req = await setup(handler)
        got = await fire(handler, req, lambda: target.write_text("hi"))
        assert got == {"path": str(target), "change": "created"}
        assert await handler.handle(req, got) == got

    async def test_created_other_file_does_not_fire(self, tmp_path: Path) -> None:
        """A sibling file's creation does not fire; the target's does."""
        target = tmp_path / "f.txt"
        handler = FileWatch(target)
        req = await setup(handler)

        def act() -> None:
            (tmp_path / "other.txt").write_text("x")
            target.write_text("y")

        got = await fire(handler, req, act)
        assert got["path"] == str(target)

    async def test_modified(self, tmp_path: Path) -> None:
        """Writing to an existing file fires `modified`."""
        target = tmp_path / "f.txt"
        target.write_text("old")
        handler = FileWatch(target, on="modified")
        req = await setup(handler)
        got = await fire(handler, req, lambda: target.write_text("new content"))
        assert got == {"path": str(target), "change": "modified"}

    async def test_replace_is_modified(self, tmp_path: Path) -> None:
        """Renaming a new version over the file fires `modified`."""
        target, new = tmp_path / "f.txt", tmp_path / "f.tmp"
        target.write_text("old")
        handler = FileWatch(target, on="modified")
        req = await setup(handler)

        def act() -> None:
            new.write_text("new")
            new.rename(target)

        assert (await fire(handler, req, act))["path"] == str(target)

    async def test_same_size_write_is_modified(self, tmp_path: Path) -> None:
        """A write that keeps the size fires `modified`, even within one timestamp tick."""
        target = tmp_path / "f.txt"
        target.write_text("aaaa")
        handler = FileWatch(target, on="modified")
        req = await setup(handler)
        stat = target.stat()

        def act() -> None:
            target.write_text("bbbb")
            os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as if in the same tick

        assert (await fire(handler, req, act))["path"] == str(target)

    async def test_deleted(self, tmp_path: Path) -> None:
        """Removing the file fires `deleted`."""
        target = tmp_path / "f.txt"
        target.write_text("x")
        handler = FileWatch(target, on="deleted")
        req = await setup(handler)
        got = await fire(handler, req, target.unlink)
        assert got == {"path": str(target), "change": "deleted"}

    async def test_exists_becomes_true(self, tmp_path: Path) -> None:
        """A missing file that appears fires `exists`."""
        target = tmp_path / "f.txt"
        handler = FileWatch(target, on="exists")
        req = await setup(handler)
        got = await fire(handler, req, target.touch)
        assert got == {"path": str(target), "change": "exists"}

    async def test_exists_glob(self, tmp_path: Path) -> None:
        """A glob fires `exists` with the path that matched."""
        handler = FileWatch(tmp_path / "*.csv", on="exists")
        req = await setup(handler)

        def act() -> None:
            (tmp_path / "a.txt").touch()
            (tmp_path / "b.csv").touch()

        got = await fire(handler, req, act)
        assert got == {"path": str(tmp_path / "b.csv"), "change": "exists"}

    async def test_nonempty(self, tmp_path: Path) -> None:
        """An entry appearing in the watched directory fires `nonempty`."""
        spool = tmp_path / "spool"
        spool.mkdir()
        handler = FileWatch(spool, on="nonempty")
        req = await setup(handler)
        got = await fire(handler, req, lambda: (spool / "job").touch())
        assert got == {"path": str(spool), "change": "nonempty"}

    async def test_missing_parent(self, tmp_path: Path) -> None:
        """With missing parents it watches the nearest ancestor and follows them as they appear."""
        target = tmp_path / "a" / "b" / "f.txt"
        handler = FileWatch(target, on="created")
        req = await setup(handler)

        def act() -> None:
            target.parent.mkdir(parents=True)
            target.touch()

        got = await fire(handler, req, act)
        assert got == {"path": str(target), "change": "created"}

    async def test_parent_replaced(self, tmp_path: Path) -> None:
        """A watched directory that is removed and made again is watched anew."""
        parent = tmp_path / "d"
        parent.mkdir()
        target = parent / "f.txt"
        handler = FileWatch(target, on="created")
        req = await setup(handler)

        def act() -> None:
            parent.rmdir()
            parent.mkdir()
            target.touch()

        assert (await fire(handler, req, act))["path"] == str(target)

    async def test_nonempty_directory_replaced(self, tmp_path: Path) -> None:
        """`nonempty` follows its directory when it is removed and made again."""
        spool = tmp_path / "spool"
        spool.mkdir()
        handler = FileWatch(spool, on="nonempty")
        req = await setup(handler)

        def act() -> None:
            spool.rmdir()
            spool.mkdir()
            (spool / "job").touch()

        assert (await fire(handler, req, act))["path"] == str(spool)


class TestRestart:
    async def test_exists_fires_at_once(self, tmp_path: Path) -> None:
        """A level condition already true fires as soon as listen starts, also on a re-run."""
        target = tmp_path / "f.txt"
        target.touch()
        handler = FileWatch(target, on="exists")
        req = await setup(handler)
        assert (await fire(handler, req))["path"] == str(target)
        again = FileWatch(target, on="exists")  # the definition is rebuilt after a restart
        assert (await fire(again, req))["path"] == str(target)

    async def test_nonempty_fires_at_once(self, tmp_path: Path) -> None:
        """A directory that already has an entry fires `nonempty` at once."""
        (tmp_path / "x").touch()
        handler = FileWatch(tmp_path, on="nonempty")
        assert (await fire(handler, await setup(handler)))["path"] == str(tmp_path)

    async def test_edge_while_down(self, tmp_path: Path) -> None:
        """Edges that happened between setup and listen (a daemon restart) fire when listen starts."""
        created, gone, changed = tmp_path / "c", tmp_path / "d", tmp_path / "m"
        gone.touch()
        changed.write_text("1")
        reqs = [
            (FileWatch(created, "created"), await setup(FileWatch(created, "created"))),
            (FileWatch(gone, "deleted"), await setup(FileWatch(gone, "deleted"))),
            (FileWatch(changed, "modified"), await setup(FileWatch(changed, "modified"))),
        ]
        created.touch()
        gone.unlink()
        changed.write_text("22")
        for handler, req in reqs:
            assert (await fire(handler, req))["change"] == handler.on


class TestTeardown:
    async def test_cancel_ends_the_subscription(self, tmp_path: Path) -> None:
        """Cancelling a pending listen ends its subscription; teardown is a harmless no-op."""
        handler = FileWatch(tmp_path / "never", on="created")
        req = await setup(handler)
        inbox = Inbox()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(handler.listen, req, inbox)
                await until(lambda: hub().subscribers(str(tmp_path)) == 1)
                tg.cancel_scope.cancel()
        assert hub().subscribers() == 0
        await handler.teardown(req, False)
        await handler.teardown(req, False)
        assert inbox.inputs == []

    async def test_teardown_without_listen(self, tmp_path: Path) -> None:
        """Teardown does not assume listen ever ran."""
        handler = FileWatch(tmp_path / "f")
        await handler.teardown(await setup(handler), False)
