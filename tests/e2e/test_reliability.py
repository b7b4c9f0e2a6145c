"""Durability under abuse: SIGKILLs under load, disk full, locks, corrupt rows, broken handlers."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import anyio

from tests.helpers.client import Client
from tests.helpers.disk import fill, hold_write_lock, small_disk
from tests.helpers.harness import Daemon, running_daemon, write_config
from tests.helpers.torture import MODULES, Plan, torture
from tests.helpers.wait import logged, shown_when, wait_status


class TestCrashTorture:
    """SIGKILL at random moments while workflows run, signals arrive and timers fire."""

    async def test_five_kills_lose_nothing(self, tmp_path: Path) -> None:
        """After 5 kills and a graceful restart, everything matches a crash-free run."""
        report = await torture(tmp_path, Plan(seed=7, kills=5, graceful_every=4))
        assert report.problems == []
        assert report.kills == 5 and report.graceful >= 1
        assert report.acked_sends > 0 and report.steps > 0


class TestHangingStep:
    """Per-step timeouts: async steps are cancelled, sync steps abandoned."""

    async def test_async_step_cancelled_and_retried(self, tmp_path: Path) -> None:
        """An async step past its timeout is cancelled, fails with TimeoutError and is retried."""
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        async with running_daemon(tmp_path, MODULES, env=env) as d, d.client() as c:
            await c.call("start", workflow="Hang", workflow_id="h", input={"id": "h"})
            shown = await wait_status(c, "h", "Finished")
            assert shown["data"]["runs"] == 1
            history = await c.call("history", workflow_id="h")
        (failure,) = await logged(d, "step_failed")
        assert "TimeoutError" in failure["error"] and failure["step"] == "stuck"
        assert [h["kind"] for h in history].count("step_failed") == 1

    async def test_sync_step_abandoned_at_its_timeout(self, tmp_path: Path) -> None:
        """A sync step past its timeout is abandoned (its thread left to end, its slot freed),
        fails with TimeoutError and is retried; what the abandoned thread does is dropped."""
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        async with running_daemon(tmp_path, MODULES, env=env) as d, d.client() as c:
            input = {"id": "s", "sync": True, "hang_s": 1.5}
            await c.call("start", workflow="Hang", workflow_id="s", input=input)
            (abandoned,) = await logged(d, "step_abandoned")
            assert abandoned["step"] == "slow" and abandoned["workflow_id"] == "s"
            assert abandoned["reason"] == "timeout" and abandoned["abandoned_total"] >= 1
            shown = await wait_status(c, "s", "Finished")
            assert shown["data"]["runs"] == 1 and "running_step" not in shown
            kinds = [h["kind"] for h in await c.call("history", workflow_id="s")]
            (failure,) = await logged(d, "step_failed")
        assert "TimeoutError" in failure["error"] and failure["step"] == "slow"
        assert kinds.count("step_abandoned") == 1 and kinds.count("step_failed") == 1
        assert (tmp_path / "steps.log").read_text().count(" slow ") == 2

    async def test_stop_with_a_hung_sync_step(self, tmp_path: Path) -> None:
        """SIGTERM while a sync step hangs: the daemon still exits after its grace period."""
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        daemon = {"shutdown_grace_s": 0.2}
        async with running_daemon(tmp_path, MODULES, env=env, daemon=daemon) as d:
            async with d.client() as c:
                input = {"id": "s", "sync": True, "timeout_s": 3600.0}
                await c.call("start", workflow="Hang", workflow_id="s", input=input)
                await shown_when(c, "s", lambda s: "running_since" in s.get("running_step", {}))
            assert d.proc is not None
            d.proc.terminate()
            await logged(d, "daemon_stopped")  # the event loop did stop: the thread is abandoned
            try:
                with anyio.fail_after(5):
                    while True:
                        if d.proc.poll() is not None:
                            break
                        await anyio.sleep(0.05)
            finally:
                if d.proc.poll() is None:
                    await d.kill()
            assert d.proc.returncode == 0


def waits_of(shown: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return a shown workflow's wait events by event name."""
    threads = shown["state"]["threads"]
    return {ev["req"]["name"]: ev for t in threads for ev in t["wait_events"]}


class TestHandlerFailures:
    """A handler whose setup or teardown raises never takes the runtime down."""

    async def test_setup_and_teardown_errors_retried(self, tmp_path: Path) -> None:
        """Errors are recorded on the wait, retried with growing backoff, and then clear."""
        marker = tmp_path / "touchy"
        setup, teardown = anyio.Path(f"{marker}.setup"), anyio.Path(f"{marker}.teardown")
        await setup.touch()
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            input = {"id": "p", "marker": str(marker)}
            await c.call("start", workflow="Picky", workflow_id="p", input=input)
            failed = await logged(d, "handler_failed", 3)
            delays = [r["retry_in_s"] for r in failed]
            assert delays == sorted(delays) and delays[0] < delays[-1]
            shown = await c.call("show", workflow_id="p")
            touch = waits_of(shown)["touch"]
            assert touch["status"] == "SetupError" and "setup refused" in touch["error"]
            assert "setup refused" in shown["error"]

            await setup.unlink()
            await shown_when(c, "p", lambda s: waits_of(s)["touch"]["status"] == "Setup")
            await teardown.touch()
            assert await c.call("send", workflow_id="p", event="go") is None
            shown = await shown_when(c, "p", lambda s: "touch" in waits_of(s) and s["error"])
            assert waits_of(shown)["touch"]["status"] == "TeardownError"
            assert "teardown refused" in shown["error"] and shown["data"]["stage"] == 1
            assert shown["waiting_for"] == ["go2"]

            await teardown.unlink()
            await shown_when(c, "p", lambda s: "touch" not in waits_of(s) and not s["error"])
            await c.call("send", workflow_id="p", event="go2")
            shown = await wait_status(c, "p", "Finished")
            assert shown["data"]["stage"] == 2
            assert (await c.request("ping"))["ok"]

    async def test_listener_that_cannot_bind_is_retried(self, tmp_path: Path) -> None:
        """A SocketListen whose address is taken after a restart is retried, not fatal."""
        path = tmp_path / "door.sock"
        d = Daemon(tmp_path, write_config(tmp_path, MODULES))
        await d.start()
        try:
            async with d.client() as c:
                input = {"id": "door", "path": str(path), "patience_s": 600}
                await c.call("start", workflow="Door", workflow_id="door", input=input)
                await wait_status(c, "door", "Waiting")
            assert await d.stop() == 0
            async with await anyio.create_unix_listener(path) as squatter:
                await d.start()
                (failed,) = await logged(d, "listen_failed")
                assert failed["event_name"] == "knock" and failed["workflow_id"] == "door"
                async with d.client() as c:
                    assert (await c.request("ping"))["ok"]
            del squatter
            with anyio.fail_after(20):
                while True:  # the listener is retried with backoff; knock once it is back
                    try:
                        async with await anyio.connect_unix(path) as s:
                            await s.send(b'"hello"\n')
                            assert b'"ok":true' in await s.receive()
                            break
                    except OSError:
                        await anyio.sleep(0.05)
            async with d.client() as c:
                shown = await wait_status(c, "door", "Finished")
                assert shown["data"]["how"] == "knock"
        finally:
            if d.proc is not None and d.proc.poll() is None:
                await d.stop()


class TestCorruptRows:
    """A broken row is held and skipped; the daemon serves every other workflow."""

    async def test_corrupt_rows_skipped(self, tmp_path: Path) -> None:
        """Invalid JSON, wrong types and an unknown type are explained by `show`."""
        d = Daemon(tmp_path, write_config(tmp_path, MODULES))
        ids = ("good", "bad_data", "bad_state", "ghost", "bad_types")
        await d.start()
        try:
            async with d.client() as c:
                for wid in ids:
                    await c.call("start", workflow="Collector", workflow_id=wid, input={"id": wid})
                for wid in ids:
                    await wait_status(c, wid, "Waiting")
            assert await d.stop() == 0
            with sqlite3.connect(tmp_path / "wd.db") as db:
                for sql in (
                    "UPDATE workflows SET data = '{not json' WHERE id = 'bad_data'",
                    "UPDATE workflows SET state = '[1,' WHERE id = 'bad_state'",
                    "UPDATE workflows SET name = 'Vanished' WHERE id = 'ghost'",
                    """UPDATE workflows SET data = '{"got": "x"}' WHERE id = 'bad_types'""",
                ):
                    db.execute(sql)
                for raw in ("{broken", "7"):
                    db.execute(
                        "INSERT INTO inbox (workflow_id, event, thread_id, pc, input, created_at)"
                        " VALUES ('good', 'add', '', 0, ?, 0)",
                        (raw,),
                    )
            db.close()
            await d.start()
            async with d.client() as c:
                for wid, why in (
                    ("bad_data", "corrupt"),
                    ("bad_state", "corrupt"),
                    ("ghost", "Vanished"),
                    ("bad_types", "corrupt"),
                ):
                    shown = await c.call("show", workflow_id=wid)
                    assert why in (shown["incompatible"] or ""), shown
                    response = await c.request("send", workflow_id=wid, event="add", input=1)
                    assert not response["ok"]
                assert len(await c.call("list")) == len(ids)
                await shown_when(c, "good", lambda s: s["data"]["got"] == [7])
                assert await c.call("send", workflow_id="good", event="add", input=8) == 2
                await c.call("send", workflow_id="good", event="close")
                await wait_status(c, "good", "Finished")
            events = [r["event"] for r in d.records()]
            assert events.count("workflow_corrupt") >= 4
        finally:
            if d.proc is not None and d.proc.poll() is None:
                await d.stop()


class TestDiskFull:
    """Checkpoints on a full disk fail clearly, are retried, and recover when space returns."""

    async def test_disk_full_then_space_returns(self, tmp_path: Path) -> None:
        """Nothing is acknowledged or corrupted while full; everything finishes afterwards."""
        async with small_disk(tmp_path / "disk") as disk:
            env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
            store = {"path": str(disk / "wd.db")}
            async with (
                running_daemon(tmp_path, MODULES, env=env, store=store) as d,
                d.client() as c,
            ):
                await self._exercise(d, c, disk)
            failed = [r for r in d.records() if r["event"] == "checkpoint_failed"]
            delays = [r["retry_in_s"] for r in failed if r.get("workflow_id") == "f"]
            assert delays == sorted(delays) and delays[0] < delays[-1]  # backoff, no busy loop
            with sqlite3.connect(disk / "wd.db") as db:
                assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            db.close()

    async def _exercise(self, d: Daemon, c: Client, disk: Path) -> None:
        with anyio.fail_after(40):
            await c.call("start", workflow="Collector", workflow_id="c", input={"id": "c"})
            await wait_status(c, "c", "Waiting")
            input = {"id": "f", "n": 8, "delay_s": 0.1}
            await c.call("start", workflow="Filler", workflow_id="f", input=input)
            ballast = await anyio.to_thread.run_sync(fill, disk)
            failed = await logged(d, "checkpoint_failed", 2, workflow_id="f")
            assert all("disk is full" in r["error"] for r in failed), failed
            sent = await c.request("send", workflow_id="c", event="add", input=1)
            assert not sent["ok"], sent
            queued = await c.request("send", workflow_id="c", event="add", input=2, wait=False)
            assert not queued["ok"], queued
            started = await c.request("start", workflow="Collector", workflow_id="x")
            assert not started["ok"], started
            assert (await c.request("ping"))["ok"]

            await anyio.Path(ballast).unlink()
            shown = await wait_status(c, "f", "Finished")
            assert len(shown["data"]["chunks"]) == 8
            assert await c.call("send", workflow_id="c", event="add", input=3) == 1
            await c.call("send", workflow_id="c", event="close")
            shown = await wait_status(c, "c", "Finished")
            assert shown["data"]["got"] == [3]
            assert not (await c.request("show", workflow_id="x"))["ok"]


class TestLockedDatabase:
    """Another process holding the write lock delays workflows but breaks nothing."""

    async def test_lock_held_elsewhere(self, tmp_path: Path) -> None:
        """Checkpoints fail with a clear error and back off; all goes on once the lock is gone."""
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        async with running_daemon(tmp_path, MODULES, env=env) as d, d.client() as c:
            await c.call("start", workflow="Collector", workflow_id="c", input={"id": "c"})
            await wait_status(c, "c", "Waiting")
            input = {"id": "f", "n": 6, "size": 10, "delay_s": 0.1}
            await c.call("start", workflow="Filler", workflow_id="f", input=input)
            lock = await anyio.to_thread.run_sync(hold_write_lock, tmp_path / "wd.db")
            try:
                sent = await c.request("send", workflow_id="c", event="add", input=1)
                assert not sent["ok"] and sent["error"]["code"] == "unavailable", sent
                assert "database is locked" in sent["error"]["message"]
                assert (await c.request("ping"))["ok"]
            finally:
                lock.execute("ROLLBACK")
                lock.close()
            shown = await wait_status(c, "f", "Finished")
            assert len(shown["data"]["chunks"]) == 6
            assert await c.call("send", workflow_id="c", event="add", input=2) == 1
            await c.call("send", workflow_id="c", event="close")
            assert (await wait_status(c, "c", "Finished"))["data"]["got"] == [2]
        failed = [r for r in d.records() if r["event"] == "checkpoint_failed"]
        assert failed and all("database is locked" in r["error"] for r in failed)
        assert all(r["retry_in_s"] > 0 for r in failed)  # every retry waits first


class TestHostileInput:
    """Input a client controls can neither corrupt a workflow nor go unanswered."""

    async def test_input_that_does_not_fit_the_fields_is_rejected(self, tmp_path: Path) -> None:
        """A float into a list[int] field is refused, so the row still loads after a restart."""
        d = Daemon(tmp_path, write_config(tmp_path, MODULES))
        await d.start()
        try:
            async with d.client() as c:
                await c.call("start", workflow="Collector", workflow_id="c", input={"id": "c"})
                await wait_status(c, "c", "Waiting")
                response = await c.request("send", workflow_id="c", event="add", input=1.5)
                assert response["error"]["code"] == "bad_input", response
                assert (await c.call("show", workflow_id="c"))["data"]["got"] == []
            assert await d.stop() == 0
            await d.start()
            async with d.client() as c:
                assert await c.call("send", workflow_id="c", event="add", input=2) == 1
                shown = await c.call("show", workflow_id="c")
                assert shown["data"]["got"] == [2] and shown["error"] is None
        finally:
            if d.proc is not None and d.proc.poll() is None:
                await d.stop()

    async def test_deeply_nested_json_is_answered(self, tmp_path: Path) -> None:
        """JSON nested a thousand deep gets a bad_request answer, not a dropped connection."""
        async with running_daemon(tmp_path, MODULES) as d:
            async with await anyio.connect_unix(d.socket) as stream:
                await stream.send(
                    b'{"id": 1, "op": "ping", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}\n"
                )
                with anyio.fail_after(10):
                    answer = await stream.receive()
            assert b'"bad_request"' in answer
