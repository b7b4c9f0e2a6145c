"""The control socket under abuse: no client can take another's slots, memory or answers."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.helpers.client import Client
from tests.helpers.harness import REPO, Daemon, running_daemon
from tests.helpers.support import needs_root
from tests.helpers.wait import logged, until, wait_status

MODULES = ["tests.workflows.control"]


async def start_tally(c: Client, wid: str, **data: Any) -> None:
    """Start a Tally and wait until it waits for its first event."""
    await c.call("start", workflow="Tally", workflow_id=wid, input={"id": wid, **data})
    await wait_status(c, wid, "Waiting")


async def ping_ok(d: Daemon) -> bool:
    """Ping on a connection of its own; True if the daemon served it."""
    async with d.client() as c:
        with anyio.fail_after(10):
            return bool((await c.request("ping"))["ok"])


#: Run as uid 65534: open connections for argv[2] seconds as fast as it can, never reading,
#: keeping the newest 200 open; print "go" once the first is open.
FLOOD_CHILD = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[2])
open_ = []
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
    except OSError:
        s.close()
        continue
    open_.append(s)
    if len(open_) == 1:
        print("go", flush=True)
    if len(open_) > 200:
        open_.pop(0).close()
"""


@needs_root
async def test_forbidden_flood_holds_no_slot(short_tmp: Path) -> None:
    """A forbidden uid flooding the socket with connections takes no slot from allowed ones."""
    os.chmod(short_tmp, 0o777)  # let uid 65534 reach the socket
    # A group allow-list makes the daemon look the stranger's groups up before refusing it.
    conf = {"socket_mode": "0666", "max_connections": 2, "allowed_groups": [4242]}
    async with running_daemon(short_tmp, MODULES, daemon=conf) as d:
        drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        child = [*drop, sys.executable, "-I", "-c", FLOOD_CHILD, str(d.socket), "4"]
        async with await anyio.open_process(child, stderr=None) as flood:
            try:
                assert flood.stdout is not None
                with anyio.fail_after(30):
                    assert await flood.stdout.receive() == b"go\n"
                served = [await ping_ok(d) for _ in range(40)]
            finally:
                with contextlib.suppress(ProcessLookupError):  # it may have ended on its own
                    flood.kill()
        assert served == [True] * 40
        await logged(d, "control_forbidden")


async def trickle(d: Daemon, closed_after: list[float]) -> None:
    """Send a ping a byte every 0.1 s (12 s in all); note when the daemon cut it off."""
    began = time.monotonic()
    async with await anyio.connect_unix(d.socket) as stream:
        for byte in b'{"op": "ping", "id": 1' + b" " * 100:
            try:
                await stream.send(bytes([byte]))
            except (anyio.BrokenResourceError, ConnectionError):
                break
            # The gap between bytes is the behaviour under test: well under any timeout.
            await anyio.sleep(0.1)
    closed_after.append(time.monotonic() - began)


async def test_slowloris_is_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    """Clients trickling a byte at a time are closed after idle_timeout_s for the whole line."""
    async with running_daemon(tmp_path, MODULES, daemon={"idle_timeout_s": 1.0}) as d:
        closed_after: list[float] = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(trickle, d, closed_after)
        assert len(closed_after) == 3 and max(closed_after) < 5, closed_after
        await logged(d, "control_request_timeout", count=3)


async def test_tricklers_holding_every_slot_make_room(tmp_path: Path) -> None:
    """With every slot held by tricklers, a new client is served: the stalest one is evicted."""
    async with running_daemon(tmp_path, MODULES, daemon={"max_connections": 3}) as d:
        closed_after: list[float] = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(trickle, d, closed_after)
            await anyio.sleep(0.3)  # the tricklers hold every slot
            with anyio.fail_after(8):
                while not await ping_ok(d):
                    pass  # a refusal waited ~1 s for a slot: no sleep needed
            evicted = (await logged(d, "control_client_evicted"))[0]
            tg.cancel_scope.cancel()
        assert evicted["stalled_s"] >= 1.0


async def test_non_reader_is_dropped(tmp_path: Path) -> None:
    """A client that asks for large answers and never reads them is dropped and logged."""
    conf = {"max_buffered_bytes": 1 << 20}
    async with running_daemon(tmp_path, MODULES, daemon=conf) as d, d.client() as c:
        await start_tally(c, "big", label="x" * 300_000)
        hog = socket.socket(socket.AF_UNIX)
        hog.connect(str(d.socket))
        hog.setblocking(False)
        asks = b"".join(
            json.dumps({"op": "show", "workflow_id": "big", "id": n}).encode() + b"\n"
            for n in range(200)
        )
        try:
            hog.send(asks)
            (dropped,) = await logged(d, "control_client_dropped")
            assert dropped["unread_bytes"] > 1 << 20
            assert (await c.call("ping"))["workflows"] == {"Waiting": 1}
            # What the kernel kept is a few answers; then the connection ends.
            received = 0
            with anyio.fail_after(10):
                while True:
                    try:
                        chunk = hog.recv(1 << 20)
                    except BlockingIOError:
                        await anyio.sleep(0.01)
                        continue
                    except ConnectionError:
                        break
                    if not chunk:
                        break
                    received += len(chunk)
            assert received < 40 * 300_000  # far from the 200 answers asked for
        finally:
            hog.close()


def send_then_read(path: Path, line: bytes) -> bytes:
    """Send `line` whole (an EPIPE would raise), then return the first response line."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendall(line)
        return s.makefile("rb").readline()


async def test_oversized_line_is_answered_and_drained(tmp_path: Path) -> None:
    """A 4 MiB line is read to its end before the close, so its sender reads `too_large`."""
    async with running_daemon(tmp_path, MODULES) as d:
        line = b'{"op": "ping", "pad": "' + b"x" * (4 << 20) + b'"}\n'
        reply = await anyio.to_thread.run_sync(send_then_read, d.socket, line)
        assert json.loads(reply)["error"]["code"] == "too_large"
        assert await ping_ok(d)


async def test_burst_of_closers_leaves_slots(tmp_path: Path) -> None:
    """Many clients that connect, send a fragment or a line and close do not fill the slots."""
    async with running_daemon(tmp_path, MODULES, daemon={"max_connections": 16}) as d:
        for burst in range(5):
            for n in range(300):
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(d.socket))
                    s.sendall(b'{"op": "ping"}\n' if n % 2 else b'{"op": "pi')
            async with d.client() as c:
                response = await c.request("ping")
            assert response["ok"], (burst, response)


def lock_waiters(inode: int) -> int:
    """Return how many processes wait for a flock(2) on the file with that inode."""
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(1 for line in lines if "->" in line and f":{inode} " in line)


@pytest.mark.skipif(not shutil.which("flock"), reason="needs flock(1) (util-linux)")
@pytest.mark.timeout(360)  # 300 interpreters starting at once on a shared 2-core machine
async def test_cron_of_300_workflowctl_sends(tmp_path: Path) -> None:
    """300 `workflowctl send` processes started at the same instant all succeed."""
    async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
        await start_tally(c, "t")
        ctl = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(d.socket)]
        send = " ".join([*ctl, "send", "t", "add", "--input", "1"])
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        gate = tmp_path / "gate"
        with gate.open("w") as held:
            # Each waits for a shared lock on `gate` while we hold it exclusively: letting
            # go starts all 300 at once, like a cron; a late one does not wait at all.
            fcntl.flock(held, fcntl.LOCK_EX)
            procs = [
                await anyio.open_process(
                    ["flock", "-s", str(gate), "sh", "-c", f"exec {send} 2>{tmp_path}/err{n}"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=None,
                    env=env,
                )
                for n in range(300)
            ]
            try:
                inode = os.fstat(held.fileno()).st_ino
                await until(lambda: lock_waiters(inode) >= 300, limit_s=60)
                fcntl.flock(held, fcntl.LOCK_UN)
                with anyio.fail_after(300):
                    codes = [await p.wait() for p in procs]
            finally:
                for p in procs:
                    if p.returncode is None:
                        p.kill()
                        await p.wait()
        failed = [
            (code, (tmp_path / f"err{n}").read_text()) for n, code in enumerate(codes) if code
        ]
        assert failed == []
        assert (await c.call("show", workflow_id="t"))["data"]["total"] == 300


async def test_list_pages_with_a_cursor(tmp_path: Path) -> None:
    """`list` answers `limit` rows and a `cursor`; the pages cover every workflow once."""
    async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
        wids = [f"t{n:02d}" for n in range(25)]
        for wid in wids:
            await start_tally(c, wid)
        first = await c.request("list", limit=10)
        assert first["ok"] and len(first["result"]) == 10 and isinstance(first["cursor"], str)
        # Workflows change while the listing goes on: none is listed twice.
        for wid in (first["result"][0]["workflow_id"], "t00"):
            assert await c.call("send", workflow_id=wid, event="add", input=1) == 1
        seen = [r["workflow_id"] for r in first["result"]]
        response = first
        while "cursor" in response:
            response = await c.request("list", cursor=response["cursor"], limit=10)
            assert response["ok"], response
            seen += [r["workflow_id"] for r in response["result"]]
        assert len(seen) == len(set(seen))
        assert set(wids) - set(seen) <= {"t00"}  # t00 moved ahead of the page being read
        # The cursor keeps its listing's filters; another filter, or a forged cursor, is refused.
        tallies = await c.request("list", workflow="Tally", limit=1)
        assert (await c.request("list", cursor=tallies["cursor"]))["result"][0]["workflow"] == (
            "Tally"
        )
        for fields in (
            {"cursor": tallies["cursor"], "workflow": "Hold"},
            {"cursor": "c1.bm9wZQ=="},
            {
                "cursor": "c1."
                + base64.urlsafe_b64encode(b"[1.0, 99999999999999999999, null, null]").decode()
            },
            {"cursor": "garbage"},
            {"limit": 1001},
        ):
            response = await c.request("list", **fields)
            assert response["error"]["code"] == "bad_request", (fields, response)
        everything = await c.request("list", limit=1000)
        assert len(everything["result"]) == 25 and "cursor" not in everything
        ctl = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(d.socket)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cut = await anyio.run_process([*ctl, "list", "--limit", "20"], env=env)
        assert len(cut.stdout.decode().splitlines()) == 1 + 20  # rows only: a header and 20
        more = cut.stderr.decode().strip()
        assert "shown; more: workflowctl list --cursor " in more
        rest = await anyio.run_process([*ctl, "list", "--cursor", more.split()[-1]], env=env)
        lines = rest.stdout.decode().splitlines()
        assert len(lines) == 1 + 5 and not rest.stderr  # header, 5 rows, nothing more


async def test_ids_events_and_threads_are_checked(tmp_path: Path) -> None:
    """An id, event or thread id that is empty, over 200 characters or has a control character
    is bad_request, and changes nothing."""
    async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
        await start_tally(c, "t")
        bad: list[tuple[str, dict[str, Any]]] = [
            ("start", {"workflow": "Tally", "workflow_id": "a\x1b[2Jb"}),
            ("start", {"workflow": "Tally", "workflow_id": "x" * 201}),
            ("start", {"workflow": "Tally", "workflow_id": ""}),
            ("send", {"workflow_id": "t", "event": "add\x07", "input": 1}),
            ("send", {"workflow_id": "t", "event": "add", "input": 1, "thread_id": "\r"}),
            ("send", {"workflow_id": "t\x9b", "event": "add", "input": 1}),
            ("show", {"workflow_id": "t\n"}),
            ("cancel", {"workflow_id": ""}),
        ]
        for op, fields in bad:
            response = await c.request(op, **fields)
            assert response["error"]["code"] == "bad_request", (op, fields, response)
            assert not any(ord(ch) < 32 for ch in response["error"]["message"])
        ok = await c.call("start", workflow="Tally", workflow_id="é" * 200, input={"id": "x"})
        assert ok["created"] is True
        shown = await c.call("show", workflow_id="t")
        assert shown["data"]["total"] == 0 and shown["status"] == "Waiting"
        assert len(await c.call("list")) == 2


async def test_max_in_flight_stops_reading(tmp_path: Path) -> None:
    """A connection with max_in_flight requests unanswered is read no further until one ends."""
    async with running_daemon(tmp_path, MODULES, daemon={"max_in_flight": 2}) as d:
        async with d.client() as c:
            follow = b'{"op": "logs", "follow": true, "id": "f"}\n'
            await c.stream.send(follow + b'{"op": "ping", "id": "p1"}\n')
            with anyio.fail_after(10):  # one stream in flight: the ping is still read
                while (await c.read())["id"] != "p1":
                    pass
        async with d.client() as c:
            await c.stream.send(follow * 2 + b'{"op": "ping", "id": "p2"}\n')
            # Nothing may come for a while: the passing time is what is under test.
            with anyio.move_on_after(1.0) as waited:
                while (await c.read())["id"] != "p2":
                    pass
            assert waited.cancelled_caught  # p2 was not read: both slots hold a stream
        assert await ping_ok(d)
