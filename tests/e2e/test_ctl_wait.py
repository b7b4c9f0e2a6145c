"""`workflowctl wait`, `start --wait`, `types` and the Python client, against a real daemon."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anyio
import pytest

from daemon.client import AsyncClient, Client, Conflict, NotFound, WaitTimeout
from tests.helpers.ctl import ctl, failed, ok
from tests.helpers.harness import running_daemon
from tests.helpers.wait import eventually, wait_status

MODULES = ["tests.workflows.ctl"]


class TestWait:
    async def test_exit_status_of_each_end(self, tmp_path: Path) -> None:
        """wait exits 0 Finished, 1 Failed, 4 Cancelled, printing each status and result."""
        async with running_daemon(tmp_path, MODULES) as d:
            s = d.socket
            for wid in ("fin", "fail", "canc"):
                ok(await ctl("start", "Latch", "--id", wid, socket=s))
            async with anyio.create_task_group() as tg:
                results: dict[str, subprocess.CompletedProcess[bytes]] = {}

                async def waiter(wid: str) -> None:
                    results[wid] = await ctl("wait", wid, socket=s)

                for wid in ("fin", "fail", "canc"):
                    tg.start_soon(waiter, wid)
                async with d.client() as c:  # the waiters are in; now end the workflows
                    await wait_status(c, "fin", "Waiting")
                    await c.call("send", workflow_id="fin", event="open")
                    await c.call("send", workflow_id="fail", event="fail")
                    await c.call("cancel", workflow_id="canc")
            raw = json.loads(ok(await ctl("--json", "wait", "fin", socket=s)))
        fin, fail, canc = (results[w] for w in ("fin", "fail", "canc"))
        assert ok(fin) == 'fin: Finished\n  {\n    "failing": false\n  }\n'
        assert fail.returncode == 1 and fail.stdout.startswith(b"fail: Failed\n")
        assert b"asked to fail" in fail.stdout
        assert canc.returncode == 4 and canc.stdout.startswith(b"canc: Cancelled")
        assert raw["timed_out"] is False
        assert raw["workflows"][0] | {"error": None} == {
            "workflow_id": "fin",
            "workflow": "Latch",
            "status": "Finished",
            "ended": True,
            "error": None,
            "result": {"failing": False},
        }

    async def test_several_any_and_timeout(self, tmp_path: Path) -> None:
        """Several ids exit with the worst end; --any returns at the first; --timeout exits 124."""
        async with running_daemon(tmp_path, MODULES) as d:
            s = d.socket
            for wid in ("a", "b", "c"):
                ok(await ctl("start", "Latch", "--id", wid, socket=s))
            timed_out = await ctl("wait", "a", "b", "--timeout", "0.5", socket=s)
            async with d.client() as c:
                await c.call("send", workflow_id="a", event="open")
            first = await ctl("wait", "a", "b", "--any", socket=s)
            async with d.client() as c:
                await c.call("send", workflow_id="b", event="fail")
            worst = await ctl("wait", "a", "b", socket=s)
            missing = await ctl("wait", "a", "nope", socket=s)
        assert timed_out.returncode == 124
        assert timed_out.stdout.decode().splitlines() == [
            "a: Waiting (not ended)",
            "b: Waiting (not ended)",
        ]
        assert ok(first).startswith("a: Finished\n") and "b:" not in first.stdout.decode()
        assert worst.returncode == 1 and b"b: Failed" in worst.stdout
        assert "error: not_found: no workflow 'nope'" in failed(missing, 1)

    async def test_result_method(self, tmp_path: Path) -> None:
        """A workflow's result() is its result; start --wait starts and waits in one go."""
        async with running_daemon(tmp_path, MODULES) as d:
            s = d.socket
            async with anyio.create_task_group() as tg:
                done: list[subprocess.CompletedProcess[bytes]] = []

                async def start_and_wait() -> None:
                    done.append(
                        await ctl(
                            "--json",
                            "start",
                            "Vetting",
                            "--id",
                            "v",
                            "--wait",
                            "--timeout",
                            "45",
                            socket=s,
                        )
                    )

                tg.start_soon(start_and_wait)
                async with d.client() as c:

                    async def waits() -> bool:
                        shown = await c.request("show", workflow_id="v")
                        return bool(shown["ok"] and shown["result"]["status"] == "Waiting")

                    await eventually(waits)
                    await c.call("send", workflow_id="v", event="note", input="hi")
                    await c.call("send", workflow_id="v", event="decide", input={"approve": True})
        (started,) = done
        result = json.loads(ok(started))
        assert result["workflows"][0]["result"] == {"approved": True, "notes": 1}

    async def test_shutdown_answers_a_wait(self, tmp_path: Path) -> None:
        """A wait in progress when the daemon stops is answered `unavailable`, not hung up on."""
        async with running_daemon(tmp_path, MODULES) as d:
            ok(await ctl("start", "Latch", "--id", "l", socket=d.socket))
            async with d.client() as c:
                wait = {"id": 1, "op": "wait", "workflow_ids": ["l"]}
                ping = {"id": 2, "op": "ping"}
                await c.stream.send(f"{json.dumps(wait)}\n{json.dumps(ping)}\n".encode())
                assert (await c.read())["id"] == 2  # the wait was read before it, and waits
                assert await d.stop() == 0
                answer = await c.read()
        assert answer["id"] == 1 and answer["error"]["code"] == "unavailable", answer


class TestStartAndTypes:
    async def test_start_says_what_it_waits_for(self, tmp_path: Path) -> None:
        """start prints the id and the events it waits for, not `Resuming`."""
        async with running_daemon(tmp_path, MODULES) as d:
            s = d.socket
            text = ok(await ctl("start", "Vetting", "--id", "v", socket=s))
            again = ok(await ctl("start", "Vetting", "--id", "v", socket=s))
            raw = json.loads(ok(await ctl("--json", "start", "Latch", "--id", "l", socket=s)))
            wrong = await ctl("start", "Latch", "--id", "v", socket=s)
        assert text == "v: Waiting for decide, expired, note\n"
        assert again == "v: Waiting (existed) for decide, expired, note\n"
        assert raw == {"workflow_id": "l", "status": "Resuming", "created": True}
        assert "exists and is a Vetting, not a Latch" in failed(wrong, 1)

    async def test_types(self, tmp_path: Path) -> None:
        """types lists each workflow type with its fields and defaults."""
        async with running_daemon(tmp_path, MODULES) as d:
            text = ok(await ctl("types", socket=d.socket))
            raw = json.loads(ok(await ctl("types", "--json", socket=d.socket)))
        assert "Vetting  Waits for `decide`" in text
        assert "  notes: list[str] = []" in text
        assert [t["workflow"] for t in raw] == ["Latch", "Vetting", "Wobbly"]
        latch = raw[0]["fields"]
        assert latch == [{"name": "failing", "type": "bool", "required": False, "default": False}]


class TestPythonClient:
    async def test_blocking_client(self, tmp_path: Path) -> None:
        """Client starts, sends, waits, lists and raises one exception class per code."""
        async with running_daemon(tmp_path, MODULES) as d:

            def use() -> dict[str, object]:
                with Client(d.socket) as c:
                    assert c.ping()["workflows"] == {}
                    assert c.start("Vetting", workflow_id="deploy-42")["created"] is True
                    with pytest.raises(WaitTimeout) as late:
                        c.wait("deploy-42", timeout=0.2)
                    assert late.value.result["timed_out"] is True
                    c.send("deploy-42", "note", "first")
                    assert c.send("deploy-42", "decide", {"approve": True, "by": "ann"}) == (
                        "approved by ann"
                    )
                    end = c.wait("deploy-42", timeout=30)
                    with pytest.raises(Conflict) as ended:
                        c.cancel("deploy-42")
                    with pytest.raises(NotFound) as missing:
                        c.show("nope")
                    assert ended.value.code == "conflict" and "already ended" in ended.value.message
                    assert missing.value.code == "not_found"
                    assert [r["workflow_id"] for r in c.list()] == ["deploy-42"]
                    c.start("Vetting", workflow_id="deploy-43")
                    first, cursor = c.page(limit=1)
                    rest, end_of = c.page(cursor=cursor)
                    assert [r["workflow_id"] for r in first + rest] == ["deploy-43", "deploy-42"]
                    assert cursor is not None and end_of is None
                    assert [h["kind"] for h in c.history("deploy-42")][-1] == "finished"
                    assert c.types()[0]["workflow"] == "Latch"
                    assert any(r.get("event") == "workflow_finished" for r in c.logs())
                    return end

            end = await anyio.to_thread.run_sync(use)
        assert end["status"] == "Finished" and end["result"] == {"approved": True, "notes": 1}

    async def test_async_client_and_discovery(self, tmp_path: Path) -> None:
        """AsyncClient has the same methods; without a socket it finds one as workflowctl does."""
        async with running_daemon(tmp_path, MODULES) as d, AsyncClient(config=d.config) as c:
            await c.start("Latch", workflow_id="l")
            async with anyio.create_task_group() as tg:
                ends: list[dict[str, object]] = []

                async def waiter() -> None:
                    async with AsyncClient(d.socket) as w:
                        ends.append(await w.wait("l", timeout=30))

                tg.start_soon(waiter)
                await eventually(lambda: waiting(c, "l"))
                assert await c.send("l", "open") is None
            shown = await c.show("l")
            await c.start("Latch", workflow_id="m")
            first, cursor = await c.page(limit=1)
            rest, end_of = await c.page(cursor=cursor)
            assert [r["workflow_id"] for r in first + rest] == ["m", "l"] and end_of is None
            with pytest.raises(NotFound):
                await c.send("nope", "x")
            records = [r async for r in c.logs(workflow_id="l")]
        assert ends[0]["status"] == "Finished" and shown["status"] == "Finished"
        assert any(r.get("event") == "workflow_finished" for r in records)


async def waiting(c: AsyncClient, wid: str) -> bool:
    """Tell whether the workflow waits for an event."""
    return bool((await c.show(wid))["status"] == "Waiting")
