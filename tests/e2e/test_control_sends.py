"""`send` through the control socket of a real workflowd: pipelined, half-closed, unread.

A waited-for send to a workflow in memory is queued as its line is read and answered by the
commit that makes it durable, with no task of its own: these tests hold that path to what
every request gets (one answer each, the half-close, backpressure on a client that never
reads).
"""

from __future__ import annotations

import json
import socket
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from tests.helpers.client import Client
from tests.helpers.harness import running_daemon
from tests.helpers.wait import logged, settled, shown_when, wait_status

MODULES = ["tests.workflows.callbacks"]


def _line(**request: Any) -> bytes:
    return json.dumps(request).encode() + b"\n"


async def _answers(c: Client, ids: set[Any]) -> dict[Any, dict[str, Any]]:
    """Read until every id in `ids` is answered; fail on a second answer to one."""
    got: dict[Any, dict[str, Any]] = {}
    with anyio.fail_after(30):
        while set(got) != ids:
            answer = await c.read()
            assert answer["id"] not in got, f"answered twice: {answer}"
            got[answer["id"]] = answer
    return got


async def test_pipelined_sends_are_each_answered_once_and_applied(short_tmp: Path) -> None:
    """Sends written in one go, mixed with bad ones, get one answer each, in any order."""
    workflows, each = ["a", "b", "c", "d"], 50
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        for wid in workflows:
            await c.call("start", workflow="BumpCounter", workflow_id=wid)
            await wait_status(c, wid, "Waiting")
        lines, sends = [], {}
        for n in range(each):
            for wid in workflows:
                rid = f"{wid}{n}"
                sends[rid] = wid
                lines.append(_line(id=rid, op="send", workflow_id=wid, event="bump", input=1))
        lines[10:10] = [
            _line(id="missing", op="send", workflow_id="nobody", event="bump"),
            _line(id="event", op="send", workflow_id="a", event="nope"),
            b'{"id": "garbage", "op": "send", "workflow_id": \n',
            _line(id="ping", op="ping"),
            _line(id="queued", op="send", workflow_id="b", event="bump", input=1, wait=False),
        ]
        await c.stream.send(b"".join(lines))
        got = await _answers(c, {*sends, "missing", "event", "ping", "queued", None})
        assert got["missing"]["error"]["code"] == "not_found", got["missing"]
        assert not got["event"]["ok"], got["event"]
        assert got[None]["error"]["code"] == "bad_request", got[None]  # the garbage line
        assert got["ping"]["ok"] and got["queued"]["result"] == {"queued": True}
        for wid in workflows:
            counts = sorted(got[rid]["result"] for rid, w in sends.items() if w == wid)
            extra = 1 if wid == "b" else 0  # the queued one counts too, at some point
            assert set(counts) <= set(range(1, each + extra + 1)) and len(counts) == each
        await settled(c)
        for wid in workflows:
            shown = await c.call("show", workflow_id=wid)
            assert shown["data"]["count"] == each + (1 if wid == "b" else 0), shown


def _send_all_then_half_close(path: Path, lines: bytes) -> list[dict[str, Any]]:
    """Send `lines`, shut the writing half, and return every answer read until EOF."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(lines)
        s.shutdown(socket.SHUT_WR)
        return [json.loads(line) for line in s.makefile("rb")]


async def test_sends_then_a_half_close_still_get_every_answer(short_tmp: Path) -> None:
    """A client that sends, then closes its writing half, is answered before the daemon closes."""
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call("start", workflow="BumpCounter", workflow_id="t")
        await wait_status(c, "t", "Waiting")
        for round_ in range(3):
            lines = b"".join(
                _line(id=n, op="send", workflow_id="t", event="bump", input=1) for n in range(40)
            )
            answers = await anyio.to_thread.run_sync(_send_all_then_half_close, d.socket, lines)
            assert sorted(a["id"] for a in answers) == list(range(40)), answers
            assert all(a["ok"] for a in answers), answers
            assert sorted(a["result"] for a in answers) == list(
                range(40 * round_ + 1, 40 * round_ + 41)
            )


def _counted(shown: dict[str, Any], *, at_least: int) -> bool:
    return int(shown["data"]["count"]) >= at_least


def _send_all_then_close(path: Path, lines: bytes) -> None:
    """Send `lines` in one write and close the connection at once, reading nothing."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(lines)


async def test_sends_from_a_client_gone_before_its_answers_are_each_applied_once(
    short_tmp: Path,
) -> None:
    """A client that sends and closes at once: every send it wrote is applied, once each.

    Its answers find nobody to write to (the send-time path's lost-peer branch); the
    connection's slots are freed, so the next client is served as ever.
    """
    sends = 12  # fewer than a connection's slots: all are taken as their bytes arrive
    async with running_daemon(short_tmp, MODULES) as d, d.client() as c:
        await c.call("start", workflow="BumpCounter", workflow_id="g")
        await wait_status(c, "g", "Waiting")
        for round_ in range(1, 4):
            lines = b"".join(
                _line(id=n, op="send", workflow_id="g", event="bump", input=1) for n in range(sends)
            )
            await anyio.to_thread.run_sync(_send_all_then_close, d.socket, lines)
            shown = await shown_when(c, "g", partial(_counted, at_least=round_ * sends))
            assert shown["data"]["count"] == round_ * sends, shown
        await settled(c)
        assert await c.call("send", workflow_id="g", event="bump", input=1) == 3 * sends + 1


async def test_a_client_not_reading_send_answers_is_read_no_further(short_tmp: Path) -> None:
    """Unread answers hold their requests' slots: the rest waits unread, and nothing is lost."""
    conf = {"max_in_flight": 4, "max_buffered_bytes": 64 << 20}
    text, asks = "x" * 60_000, 100
    async with running_daemon(short_tmp, MODULES, daemon=conf) as d, d.client() as c:
        await c.call("start", workflow="Echo", workflow_id="e")
        await wait_status(c, "e", "Waiting")
        async with d.client() as hog:
            lines = [_line(id=n, op="send", workflow_id="e", event="echo", input=text)
                     for n in range(asks)]  # fmt: skip
            async with anyio.create_task_group() as tg:
                # The requests are more than the kernel holds: this send waits for reading.
                tg.start_soon(hog.stream.send, b"".join(lines))
                # Nothing changes for a while: the passing time is what is under test.
                await anyio.sleep(1.0)
                applied = (await c.call("show", workflow_id="e"))["data"]["echoed"]
                # The kernel holds a few answers of 60 kB; then 4 wait unread, and no more
                # requests are taken.
                assert applied < asks // 2, f"{applied} applied for a client that reads none"
                got = await _answers(hog, set(range(asks)))
            assert all(a["ok"] and a["result"] == text for a in got.values())
        assert (await c.call("show", workflow_id="e"))["data"]["echoed"] == asks


async def test_pipelined_sends_past_the_slots_are_applied_in_order(short_tmp: Path) -> None:
    """More sends in one write than a connection's slots: each applied in the order sent."""
    asks = 60
    async with (
        running_daemon(short_tmp, MODULES, daemon={"max_in_flight": 3}) as d,
        d.client() as c,
    ):
        await c.call("start", workflow="BumpCounter", workflow_id="o")
        await wait_status(c, "o", "Waiting")
        for round_ in range(3):
            base = round_ * (asks + 1)
            lines = [_line(id=base + n, op="send", workflow_id="o", event="bump", input=1)
                     for n in range(asks)]  # fmt: skip
            lines.insert(asks // 2, _line(id="ping", op="ping"))
            await c.stream.send(b"".join(lines))
            got = await _answers(c, {*(base + n for n in range(asks)), "ping"})
            assert got.pop("ping")["ok"]
            # The n-th send of the write is the n-th bump applied: none overtook another.
            assert {rid: a["result"] for rid, a in got.items()} == {
                base + n: round_ * asks + n + 1 for n in range(asks)
            }, got


async def test_sends_one_by_one_keep_a_connection_past_the_idle_timeout(short_tmp: Path) -> None:
    """The idle timeout counts from the last request: a client sending steadily is not cut."""
    async with (
        running_daemon(short_tmp, MODULES, daemon={"idle_timeout_s": 1.0}) as d,
        d.client() as c,
    ):
        await c.call("start", workflow="BumpCounter", workflow_id="s")
        await wait_status(c, "s", "Waiting")
        began = time.monotonic()
        sent = 0
        while time.monotonic() - began < 3.0:
            sent += 1
            answer = await c.request("send", workflow_id="s", event="bump", input=1)
            assert answer["ok"] and answer["result"] == sent, answer
            # A gap well under the timeout, three times over it in all: what is tested.
            await anyio.sleep(0.2)
        assert (await c.call("show", workflow_id="s"))["data"]["count"] == sent


async def test_a_line_trickled_after_sends_is_closed_at_the_idle_timeout(short_tmp: Path) -> None:
    """Bytes of a line begun after answered sends do not hold the connection open."""
    async with running_daemon(short_tmp, MODULES, daemon={"idle_timeout_s": 1.0}) as d:
        async with d.client() as c:
            await c.call("start", workflow="BumpCounter", workflow_id="t")
            await wait_status(c, "t", "Waiting")
            for n in range(1, 4):
                assert await c.call("send", workflow_id="t", event="bump", input=1) == n
            closed = False
            for byte in b'{"op": "ping", "id": 1' + b" " * 100:  # 12 s at 0.1 s a byte
                try:
                    await c.stream.send(bytes([byte]))
                except (anyio.BrokenResourceError, ConnectionError):
                    closed = True
                    break
                # The gap between bytes is the behaviour under test: well under the timeout.
                await anyio.sleep(0.1)
        assert closed, "a line trickled for 12 s was never cut off"
        await logged(d, "control_request_timeout")
