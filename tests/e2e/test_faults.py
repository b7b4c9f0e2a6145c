"""Faults never stall, crash or silently break a workflow: background tasks, broken waits, inbox."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.helpers.client import Client
from tests.helpers.disk import fill, hold_write_lock, small_disk
from tests.helpers.disk_torture import FullPlan, disk_full_torture
from tests.helpers.harness import Daemon, running_daemon
from tests.helpers.wait import eventually, logged, shown_when, until, wait_status

MODULES = ["tests.workflows.faults"]


def waits_of(shown: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return a shown workflow's wait events by event name."""
    threads = shown["state"]["threads"]
    return {ev["req"]["name"]: ev for t in threads for ev in t["wait_events"]}


def alive(d: Daemon) -> bool:
    """Tell whether the daemon process is still running."""
    return d.proc is not None and d.proc.poll() is None


class TestRetention:
    """The retention task survives a database it cannot write, and catches up afterwards."""

    async def test_locked_database_during_retention(self, tmp_path: Path) -> None:
        """A write lock held across a retention run is logged; once released, old ones go."""
        store = {"retention_interval_s": 0.5, "keep_finished_days": 1}
        async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
            gate = str(tmp_path / "gate")
            for wid in ("old", "live"):
                await c.call("start", workflow="Gated", workflow_id=wid, input={"gate": gate})
            await c.call("send", workflow_id="old", event="close")
            await wait_status(c, "old", "Finished")
            lock = await anyio.to_thread.run_sync(hold_write_lock, tmp_path / "wd.db", "IMMEDIATE")
            try:
                # Aged inside the lock's transaction: retention can see it only once it ends.
                lock.execute("UPDATE workflows SET updated_at = updated_at - 40 * 86400")
                (failed, *_) = await logged(d, "task_failed", task="retention", limit_s=30)
                assert "database is locked" in failed["error"] and failed["retry_in_s"] > 0
                assert (await c.request("ping"))["ok"]
            finally:
                lock.execute("COMMIT")
                lock.close()
            await logged(d, "workflows_deleted", limit_s=30)
            gone = await c.request("show", workflow_id="old")
            assert gone["error"]["code"] == "not_found", gone
            assert (await c.call("show", workflow_id="live"))["status"] == "Waiting"
            assert await c.call("send", workflow_id="live", event="add", input={"n": 1}) == 1
            assert alive(d)


class TestBrokenSibling:
    """A case whose setup always fails is retried and shown; its siblings work meanwhile."""

    @pytest.mark.parametrize("broken", ["socket", "raise"])
    async def test_signal_sibling_answers(self, tmp_path: Path, broken: str) -> None:
        """Sends get their answer, --no-wait sends are applied in order, `show` names the error."""
        input = {"broken": broken, "path": str(tmp_path / "missing" / "door.sock")}
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="Jammed", workflow_id="j", input=input)
            shown = await shown_when(
                c, "j", lambda s: waits_of(s).get("door", {}).get("status") == "SetupError"
            )
            why = "socket directory does not exist" if broken == "socket" else "never sets up"
            assert why in waits_of(shown)["door"]["error"] and why in shown["error"]
            with anyio.fail_after(5):
                assert await c.call("send", workflow_id="j", event="poke", input=1) == 1
            for n in (2, 3, 4):
                queued = await c.call("send", workflow_id="j", event="poke", input=n, wait=False)
                assert queued == {"queued": True}
            shown = await shown_when(c, "j", lambda s: len(s["data"]["pokes"]) >= 4, limit_s=5)
            assert shown["data"]["pokes"] == [1, 2, 3, 4]
            shown = await shown_when(
                c, "j", lambda s: waits_of(s).get("door", {}).get("status") == "SetupError"
            )
            assert waits_of(shown)["poke"]["status"] == "Setup"
            await logged(d, "handler_failed", 2, workflow_id="j")  # retried, not given up

    async def test_timer_sibling_fires_on_time(self, tmp_path: Path) -> None:
        """A 1 s Timer beside a broken case fires after about a second, not after the backoff."""
        input = {"path": str(tmp_path / "missing" / "door.sock"), "after_s": 1.0}
        runtime = {"retry_initial_s": 4.0, "retry_max_s": 8.0}  # a backoff longer than the timer
        async with running_daemon(tmp_path, MODULES, runtime=runtime) as d, d.client() as c:
            began = time.time()
            await c.call("start", workflow="Jammed", workflow_id="t", input=input)
            shown = await wait_status(c, "t", "Finished", limit_s=8)
            late = shown["data"]["woke_at"] - began
            assert 1.0 <= late < 3.0, late
            (failed,) = await logged(d, "handler_failed", workflow_id="t")
            assert "socket directory does not exist" in failed["error"]


async def applied_in_order(
    c: Client, wid: str, want: list[int], limit_s: float = 30
) -> dict[str, Any]:
    """Wait until the Gated workflow took the last value of `want`; check it took `want`."""
    shown = await shown_when(c, wid, lambda s: want[-1] in s["data"]["got"], limit_s)
    assert shown["data"]["got"] == want
    return shown


def pending_inbox(db: Path) -> int:
    """Count the inbox rows not yet applied."""
    with sqlite3.connect(db) as conn:
        (count,) = conn.execute("SELECT COUNT(*) FROM inbox").fetchone()
    conn.close()
    return int(count)


@asynccontextmanager
async def held_event(c: Client, gate: Path) -> AsyncIterator[None]:
    """Queue add 0 (held at the gate) then adds 1-4 with --no-wait; open the gate on exit."""
    await c.call("start", workflow="Gated", workflow_id="g", input={"gate": str(gate)})
    await wait_status(c, "g", "Waiting")
    add = {"workflow_id": "g", "event": "add", "wait": False}
    assert await c.call("send", **add, input={"n": 0, "hold": True}) == {"queued": True}
    await until(lambda: Path(f"{gate}.waiting").exists())  # taken, not yet saved
    for n in (1, 2, 3, 4):
        assert await c.call("send", **add, input={"n": n}) == {"queued": True}
    yield
    await anyio.Path(gate).touch()


class TestInboxStrandedNever:
    """An acknowledged --no-wait event whose checkpoint fails is retried in order, no restart."""

    async def _check_recovers(
        self,
        d: Daemon,
        c: Client,
        db: Path,
        release: Callable[[], Any],
        late: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """Wait for the failed save, release the fault, check every event lands in order.

        `late` tells whether an add 5 sent during the fault was acknowledged: then it must
        land last; if it was refused, it must not land at all.
        """
        failed = await logged(d, "checkpoint_failed", workflow_id="g", limit_s=30)
        release()
        want = [0, 1, 2, 3, 4]
        if late is not None and await late():
            want.append(5)
        await applied_in_order(c, "g", want)
        await eventually(lambda: anyio.to_thread.run_sync(lambda: pending_inbox(db) == 0))
        assert failed[0]["retry_in_s"] > 0 and alive(d)
        await c.call("send", workflow_id="g", event="close")
        await wait_status(c, "g", "Finished")

    async def test_locked_database(self, tmp_path: Path) -> None:
        """A write lock held while the held event is saved delays it; nothing jumps the queue."""
        db = tmp_path / "wd.db"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c, d.client() as c2:
            async with held_event(c, tmp_path / "gate"):
                lock = await anyio.to_thread.run_sync(hold_write_lock, db, "IMMEDIATE")
            answered = anyio.Event()
            answers: list[dict[str, Any]] = []

            async def send_late() -> None:
                add = {"workflow_id": "g", "event": "add", "wait": False}
                answers.append(await c2.request("send", **add, input={"n": 5}))
                answered.set()

            async def late() -> bool:
                await answered.wait()
                return bool(answers[0]["ok"])

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_late)  # arrives while the lock is held
                    await self._check_recovers(d, c, db, lock.close, late)  # close: rollback
            finally:
                lock.close()

    async def test_disk_full(self, tmp_path: Path) -> None:
        """A full disk while the held event is saved delays it; nothing jumps the queue."""
        async with small_disk(tmp_path / "disk") as disk:
            db = disk / "wd.db"
            store = {"path": str(db)}
            async with running_daemon(tmp_path, MODULES, store=store) as d, d.client() as c:
                async with held_event(c, tmp_path / "gate"):
                    ballast = await anyio.to_thread.run_sync(fill, disk)
                try:
                    await self._check_recovers(d, c, db, ballast.unlink)
                finally:
                    ballast.unlink(missing_ok=True)
                failed = [r for r in d.records() if r["event"] == "checkpoint_failed"]
                assert all("full" in r["error"] for r in failed), failed


class TestDiskFullTorture:
    """The crash torture's disk-full phase, short: the disk fills up six times under load."""

    async def test_nothing_lost_stranded_or_reordered(self, tmp_path: Path) -> None:
        """Every acknowledged send is applied once, in order, without a restart."""
        report = await disk_full_torture(tmp_path, FullPlan(seed=3, collectors=8, fills=6))
        if report.skipped:
            pytest.skip(report.skipped)
        assert report.problems == []
        assert (report.lost, report.stranded, report.out_of_order) == (0, 0, 0)
        assert report.daemon_exits == 0 and report.refused_but_applied == 0
        assert report.fills == 6 and report.checkpoint_failures > 0  # the disk was really full
        assert report.acked_no_wait > 0 and report.refused_sends > 0


class TestWalTakesTheDisk:
    """A WAL that a long read kept from starting over never takes the disk's last room."""

    async def test_writes_resume_once_the_reader_lets_go(self, tmp_path: Path) -> None:
        """Writes stop short of a full disk; once the read ends, the WAL is checkpointed."""
        async with small_disk(tmp_path / "disk") as disk:
            db = disk / "wd.db"
            store = {"path": str(db)}
            async with (
                running_daemon(tmp_path, ["tests.workflows.callbacks"], store=store) as d,
                d.client() as c,
            ):
                await c.call("start", workflow="BumpCounter", workflow_id="kept")
                # Another program's read transaction: no checkpoint gets past its snapshot, so
                # the WAL grows with every commit instead of starting over.
                reader = sqlite3.connect(db, isolation_level=None)
                try:
                    reader.execute("BEGIN")
                    reader.execute("SELECT COUNT(*) FROM workflows").fetchone()
                    refused = await self._start_until_refused(c)
                finally:
                    reader.close()
                assert "full" in refused["error"]["message"], refused

                async def bumped() -> bool:
                    answer = await c.request("send", workflow_id="kept", event="bump", input=1)
                    return bool(answer["ok"])

                await eventually(bumped, limit_s=30)
                assert (disk / "wd.db-wal").stat().st_size < 8 << 20  # its room given back

    @staticmethod
    async def _start_until_refused(c: Client) -> dict[str, Any]:
        """Start workflows (new pages: a checkpoint must grow the file) until one is refused."""
        for n in range(20_000):
            answer = await c.request("start", workflow="BumpCounter", workflow_id=f"w{n:05d}")
            if not answer["ok"]:
                return answer
        raise AssertionError("20,000 workflows started on a 16 MB disk")
