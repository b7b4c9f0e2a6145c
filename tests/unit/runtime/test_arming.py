"""Armed waits in process: each handler kind fires, is torn down when another case wins, and
survives a restart; nothing leaks (arms, listen tasks, descriptors, socket files).

A real Runtime on a real SQLite store (a fake clock where timer logic needs it); files, inotify
and sockets are real. tests/e2e/test_handlers.py checks the same inside a real `workflowd`.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import structlog

from daemon import CallbackRequest, On, S, Section, Wait, Workflow
from daemon.clock import FakeClock
from daemon.core.state import EventStatus, State, Thread, ThreadStatus, WaitEvent, WorkflowStatus
from daemon.errors import CallbackNotFound, StaleCallback
from daemon.runtime.arming import FIRE_BATCH, Arms, key_of
from daemon.runtime.runtime import Runtime
from daemon.store.sqlite import SQLiteStore
from handlers import Signal, Timer
from handlers._dirwatch import hub
from tests.helpers.probes import exchange, fds, unix_bound, unix_listening
from tests.helpers.wait import until, wait_runtime_status
from tests.workflows.handler import Guarded, Race

REGISTRY: dict[str, type[Workflow]] = {c.name: c for c in (Guarded, Race)}


@asynccontextmanager
async def running(db: Path, clock: FakeClock | None = None) -> AsyncIterator[Runtime]:
    """Open a store and a runtime on it for the body of the block."""
    async with SQLiteStore.open(db) as store, Runtime.open(store, REGISTRY, clock=clock) as rt:
        yield rt


async def _no_submit(req: CallbackRequest, input: Any, wait: bool) -> None:
    raise AssertionError(f"no listener here, yet {req} was submitted")


def _no_fire(req: CallbackRequest, input: Any) -> None:
    raise AssertionError(f"no timer here, yet {req} fired")


def listen_tasks() -> int:
    """Count the runtime's listen tasks still running in this event loop."""
    return sum(1 for t in anyio.get_running_tasks() if (t.name or "").endswith("Arms._listen"))


def free_port() -> int:
    """Return a TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TestTimer:
    """Timer, through the runtime's heap with a fake clock."""

    async def test_fires_with_deadline(self, tmp_path: Path) -> None:
        """The timer case runs once the clock passes the deadline; the input carries both times."""
        clock = FakeClock()
        async with running(tmp_path / "wf.db", clock) as rt:
            start = clock.now()
            await rt.start("Guarded", "t", {"kind": "timer", "after": 60})
            await wait_runtime_status(rt, "t", "Waiting")
            assert len(rt.arms) == 1
            clock.advance(61)
            shown = await wait_runtime_status(rt, "t", "Finished")
            assert shown["data"]["ran"] == ["it"]
            assert shown["data"]["seen"]["got"] == {"deadline": start + 60, "fired_at": start + 61}
            assert len(rt.arms) == 0

    async def test_disarmed_when_signal_wins(self, tmp_path: Path) -> None:
        """A stop signal wins; the timer is disarmed and its deadline passing does nothing."""
        clock = FakeClock()
        async with running(tmp_path / "wf.db", clock) as rt:
            await rt.start("Guarded", "t", {"kind": "timer", "after": 60})
            await wait_runtime_status(rt, "t", "Waiting")
            assert await rt.send("t", "stop", "done") == "stopped: done"
            await wait_runtime_status(rt, "t", "Finished")
            assert len(rt.arms) == 0
            # A witness timer due just after t's: once it has fired, the heap has handled every
            # entry up to t's deadline, so a wrongly armed timer of t would have fired too.
            await rt.start("Guarded", "witness", {"kind": "timer", "after": 61})
            await wait_runtime_status(rt, "witness", "Waiting")
            clock.advance(3600)
            await wait_runtime_status(rt, "witness", "Finished")
            await rt.wait_idle()
            assert (await rt.show("t"))["data"]["ran"] == ["stop"]

    async def test_disarmed_timers_do_not_pile_up(self, tmp_path: Path) -> None:
        """A loop whose signal always beats a long timer keeps the timer heap small."""
        async with running(tmp_path / "wf.db", FakeClock()) as rt:
            await rt.start("Race", "r", {"rounds": 300, "after": 86400})
            for n in range(300):
                await wait_runtime_status(rt, "r", "Waiting")
                assert await rt.send("r", "poke") == n
            await wait_runtime_status(rt, "r", "Finished")
            assert len(rt.arms) == 0
            assert len(rt.arms._heap) < 100  # the heap itself: stale entries are what leaks

    async def test_restart_keeps_the_stored_deadline(self, tmp_path: Path) -> None:
        """A deadline that passed while down fires on restart, with the deadline set up before."""
        db, clock = tmp_path / "wf.db", FakeClock()
        async with running(db, clock) as rt:
            start = clock.now()
            await rt.start("Guarded", "t", {"kind": "timer", "after": 60})
            await wait_runtime_status(rt, "t", "Waiting")
        clock.advance(7200)
        async with running(db, clock) as rt:
            shown = await wait_runtime_status(rt, "t", "Finished")
            assert shown["data"]["ran"] == ["it"]
            assert shown["data"]["seen"]["got"]["deadline"] == start + 60

    async def test_failed_fire_is_retried(self) -> None:
        """A timer whose callback cannot be queued stays armed and fires on the retry."""
        clock, calls = FakeClock(), []

        def fire(req: CallbackRequest, input: Any) -> None:
            calls.append(input)
            if len(calls) == 1:
                raise RuntimeError("queue broke")

        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                arms = Arms(tg, clock, _no_submit, lambda req, error: None, fire=fire)
                tg.start_soon(arms.run_timers)
                deadline = clock.now() + 60
                req = CallbackRequest("w", "_main_", "wake", 1, json.dumps({"deadline": deadline}))
                arms.sync("w", {key_of(req): (req, Timer(after=60))})
                clock.advance(61)
                await until(lambda: len(calls) == 2)  # after the supervisor's 1 s backoff
                assert arms.armed("w") == set()
                tg.cancel_scope.cancel()
        assert calls[1] == {"deadline": deadline, "fired_at": deadline + 1}
        (failed,) = [r for r in logs if r["event"] == "task_failed"]
        assert failed["task"] == "timers" and "queue broke" in failed["error"]

    async def test_bulk_armed_timers_fire_in_deadline_order_once(self) -> None:
        """`arm_timers` (recovery's way) skips keys armed already; each fires once, in order."""
        clock, fired = FakeClock(), []

        def fire(req: CallbackRequest, input: Any) -> None:
            fired.append((req.workflow_id, req.name))

        async with anyio.create_task_group() as tg:
            arms = Arms(tg, clock, _no_submit, lambda req, error: None, fire=fire)
            tg.start_soon(arms.run_timers)
            now = clock.now()
            a1, a2, b = ("a", "_main_", "t1", 1), ("a", "t2", "t2", 1), ("b", "_main_", "t", 3)
            arms.arm_timers([(b, now + 30), (a1, now + 10), (a2, now + 20)])
            arms.arm_timers([(a1, now + 5)])  # armed already: the first deadline holds
            assert arms.armed("a") == {a1, a2} and arms.armed("b") == {b}
            assert arms.kinds() == {"timer": 3, "listener": 0}
            arms.disarm(a2)
            assert arms.armed("a") == {a1}
            clock.advance(6)
            await anyio.sleep(0.01)  # the window in which a1 must not fire early
            assert fired == []
            clock.advance(40)
            await until(lambda: len(fired) == 2)
            assert fired == [("a", "t1"), ("b", "t")]
            assert arms.armed("a") == set() and len(arms) == 0
            tg.cancel_scope.cancel()


class _Counted(FakeClock):
    """A fake clock that counts how often the timer loop went to sleep on it."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0

    async def sleep_until(self, deadline: float) -> None:
        self.sleeps += 1
        await super().sleep_until(deadline)


@dataclass
class NoDefinition(Workflow):
    """A workflow whose definition must not be built (re-arming a timer needs none)."""

    def definition(self) -> Section:
        raise AssertionError("the definition was built")


@dataclass
class Listening(Workflow):
    """Waits on a listener and a signal; counts how often its definition is built."""

    built: int = 0

    def definition(self) -> Section:
        self.built += 1
        return S(Wait("nap", On("hear", _Listener(fails=0)), On("poke", Signal())))


def _waiting(wid: str, events: list[WaitEvent], status: str = "Waiting") -> State:
    """Return the state of a workflow whose main thread waits on `events`."""
    thread = Thread("_main_", "main", ThreadStatus.WAITING_EVENT, "nap", wait_events=events)
    return State(wid, "Test", WorkflowStatus(status), [thread])


def _timer_event(wid: str, name: str, pc: int, deadline: float) -> WaitEvent:
    data = json.dumps({"deadline": deadline})
    return WaitEvent("timer", CallbackRequest(wid, "_main_", name, pc, data), EventStatus.SETUP)


class TestBatches:
    """Due timers are handed over in one wake; a re-arm builds no definition for a timer."""

    async def test_timers_due_together_fire_in_one_wake_in_order(self) -> None:
        """A thousand timers due by the same moment all fire after one wake, in deadline order."""
        clock, fired = _Counted(), list[tuple[CallbackRequest, Any]]()
        async with anyio.create_task_group() as tg:
            arms = Arms(tg, clock, _no_submit, lambda req, error: None, fire=_append(fired))
            now = clock.now()
            # Armed in reverse, so that the order they fire in is the heap's.
            arms.arm_timers(
                ((f"w{i:04d}", "_main_", "t", 1), now + 10 + i / 1000) for i in range(1000)[::-1]
            )
            arms.arm_timer(("later", "_main_", "t", 1), now + 3600)
            tg.start_soon(arms.run_timers)
            await until(lambda: clock.sleeps == 1)
            clock.advance(20)
            await until(lambda: clock.sleeps == 2)  # asleep again, until the later one
            assert [req.workflow_id for req, _ in fired] == [f"w{i:04d}" for i in range(1000)]
            assert all(got["fired_at"] == now + 20 for _, got in fired)
            assert len(arms) == 1 and arms.armed("w0000") == set()
            tg.cancel_scope.cancel()

    async def test_a_large_wake_lets_the_loop_run_between_batches(self) -> None:
        """5,000 timers due at once are handed over FIRE_BATCH at a time, the loop turning
        between batches (other tasks run), still all in deadline order after one wake."""
        clock, fired = _Counted(), list[tuple[CallbackRequest, Any]]()
        seen: list[int] = []
        async with anyio.create_task_group() as tg:
            arms = Arms(tg, clock, _no_submit, lambda req, error: None, fire=_append(fired))
            now, n = clock.now(), 5000
            arms.arm_timers(((f"w{i:04d}", "_main_", "t", 1), now + 10 + i / n) for i in range(n))
            tg.start_soon(arms.run_timers)
            await until(lambda: clock.sleeps == 1)

            async def watch() -> None:
                while len(fired) < n:
                    seen.append(len(fired))
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(watch)
            await anyio.lowlevel.checkpoint()
            clock.advance(20)
            await until(lambda: len(fired) == n)
            assert [req.workflow_id for req, _ in fired] == [f"w{i:04d}" for i in range(n)]
            assert {got["fired_at"] for _, got in fired} == {now + 20}
            # The watcher ran in between: it saw some handed over, not yet all.
            between = [k for k in seen if 0 < k < n]
            assert between and max(b - a for a, b in pairwise(between)) <= (FIRE_BATCH), between[
                :10
            ]
            tg.cancel_scope.cancel()

    async def test_rearm_arms_a_new_timer_from_its_setup_data(self) -> None:
        """A timer set up by a resume is armed from its stored deadline, without a definition."""
        clock, fired = FakeClock(), list[tuple[CallbackRequest, Any]]()
        async with anyio.create_task_group() as tg:
            arms = Arms(tg, clock, _no_submit, lambda req, error: None, fire=_append(fired))
            tg.start_soon(arms.run_timers)
            due = clock.now() + 60
            wf = NoDefinition()
            state = _waiting("w", [_timer_event("w", "wake", 3, due)])
            arms.rearm(wf, state)
            arms.rearm(wf, state)  # nothing changed: nothing more armed
            assert arms.armed("w") == {("w", "_main_", "wake", 3)} and len(arms) == 1
            clock.advance(59)
            await anyio.sleep(0.01)  # the window in which it must not fire early
            assert fired == []
            clock.advance(2)
            await until(lambda: len(fired) == 1)
            assert fired[0][1] == {"deadline": due, "fired_at": due + 1}
            tg.cancel_scope.cancel()

    async def test_rearm_drops_a_wait_that_moved_on(self) -> None:
        """A wait handled or replaced by the next iteration (a new pc) is disarmed on re-arm."""
        clock = FakeClock()
        async with anyio.create_task_group() as tg:
            arms = Arms(tg, clock, _no_submit, lambda req, error: None, fire=_no_fire)
            wf, due = NoDefinition(), clock.now() + 60
            arms.rearm(wf, _waiting("w", [_timer_event("w", "wake", 3, due)]))
            arms.rearm(wf, _waiting("w", [_timer_event("w", "wake", 5, due)]))
            assert arms.armed("w") == {("w", "_main_", "wake", 5)}
            handled = _timer_event("w", "wake", 5, due)
            handled.status = EventStatus.PENDING_TEARDOWN
            arms.rearm(wf, _waiting("w", [handled], "Resuming"))
            assert arms.armed("w") == set() and len(arms) == 0
            arms.rearm(wf, _waiting("w", [_timer_event("w", "wake", 7, due)], "Finished"))
            assert len(arms) == 0  # an ended workflow arms nothing
            tg.cancel_scope.cancel()

    async def test_rearm_builds_the_definition_for_other_waits_only(self) -> None:
        """A listener is armed from its handler, so from the definition; a timer never needs it."""
        wf, delivered = Listening(), anyio.Event()

        async def submit(req: CallbackRequest, input: Any, wait: bool) -> None:
            delivered.set()

        async with anyio.create_task_group() as tg:
            clock = FakeClock()
            arms = Arms(tg, clock, submit, lambda req, error: None, fire=_no_fire)
            hear = WaitEvent("test", CallbackRequest("w", "_main_", "hear", 2), EventStatus.SETUP)
            arms.rearm(wf, _waiting("w", [hear]))
            arms.rearm(wf, _waiting("w", [hear]))  # armed already: no definition needed
            assert wf.built == 1 and arms.kinds() == {"timer": 0, "listener": 1}
            with anyio.fail_after(10):
                await delivered.wait()
            poke = WaitEvent("signal", CallbackRequest("w", "_main_", "poke", 2), EventStatus.SETUP)
            arms.rearm(wf, _waiting("w", [poke]))  # a signal: built, arms nothing
            assert wf.built == 2 and len(arms) == 0
            arms.rearm(wf, _waiting("w", [_timer_event("w", "wake", 4, clock.now() + 9)]))
            assert wf.built == 2 and arms.kinds() == {"timer": 1, "listener": 0}
            tg.cancel_scope.cancel()


def _append(into: list[tuple[CallbackRequest, Any]]) -> Any:
    def fire(req: CallbackRequest, input: Any) -> None:
        into.append((req, input))

    return fire


class _Listener:
    """An active handler whose listen fails `fails` times, then delivers `value` (stand-in)."""

    type = "test"

    def __init__(self, fails: int, value: Any = "hi") -> None:
        self.fails, self.value = fails, value

    async def setup(self, req: CallbackRequest) -> str:
        return ""

    async def listen(self, req: CallbackRequest, deliver: Any) -> None:
        if self.fails:
            self.fails -= 1
            raise OSError("cannot watch /x")
        await deliver(self.value)
        await anyio.sleep_forever()

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        pass


class TestListenFailed:
    """A listener that fails is reported as a broken wait; a refused delivery is not."""

    async def test_failing_listen_is_reported(self) -> None:
        """Its request and error reach `broken`; the listener still retries on its own."""
        broken: list[tuple[CallbackRequest, str]] = []
        delivered = anyio.Event()

        async def submit(req: CallbackRequest, input: Any, wait: bool) -> None:
            delivered.set()

        async with anyio.create_task_group() as tg:
            arms = Arms(
                tg, FakeClock(), submit, lambda req, e: broken.append((req, e)), fire=_no_fire
            )
            req = CallbackRequest("w", "_main_", "it", 3)
            arms.sync("w", {key_of(req): (req, _Listener(fails=1))})
            with anyio.fail_after(10):
                await delivered.wait()  # retried after its 1 s backoff
            assert broken == [(req, "OSError: cannot watch /x")]
            tg.cancel_scope.cancel()

    async def test_refused_delivery_is_not_reported(self) -> None:
        """An error raised by the delivery (the workflow refused it) is no broken wait."""
        broken: list[tuple[CallbackRequest, str]] = []
        calls: list[Any] = []

        async def submit(req: CallbackRequest, input: Any, wait: bool) -> None:
            calls.append(input)
            raise CallbackNotFound("gone")

        async with anyio.create_task_group() as tg:
            arms = Arms(
                tg, FakeClock(), submit, lambda req, e: broken.append((req, e)), fire=_no_fire
            )
            req = CallbackRequest("w", "_main_", "it", 3)
            arms.sync("w", {key_of(req): (req, _Listener(fails=0))})
            await until(lambda: len(calls) == 2)  # retried after its 1 s backoff
            assert broken == []
            tg.cancel_scope.cancel()


class TestFileWatch:
    """FileWatch, with real files and inotify, in process."""

    async def test_created_fires(self, tmp_path: Path) -> None:
        """Creating the file fires the case with its path; the watch is closed afterwards."""
        target = tmp_path / "drop" / "x.txt"
        target.parent.mkdir()
        base = fds()["inotify"]
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Guarded", "f", {"kind": "file", "path": str(target)})
            await wait_runtime_status(rt, "f", "Waiting")
            await until(lambda: fds()["inotify"] == base + 1)
            target.write_text("hi")
            shown = await wait_runtime_status(rt, "f", "Finished")
            assert shown["data"]["seen"]["got"] == {"path": str(target), "change": "created"}
            await until(lambda: fds()["inotify"] == base and listen_tasks() == 0)
            assert len(rt.arms) == 0

    async def test_watch_removed_when_signal_wins(self, tmp_path: Path) -> None:
        """A stop signal wins; the inotify watch and the listen task are gone."""
        target = tmp_path / "x.txt"
        base = fds()["inotify"]
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Guarded", "f", {"kind": "file", "path": str(target)})
            await wait_runtime_status(rt, "f", "Waiting")
            await until(lambda: fds()["inotify"] == base + 1)
            await rt.send("f", "stop", "done")
            await wait_runtime_status(rt, "f", "Finished")
            assert len(rt.arms) == 0
            await until(lambda: fds()["inotify"] == base and listen_tasks() == 0)
            # A witness watching the same file: once the late write has reached it (through
            # inotify and the same 50 ms debounce), a leftover watch of f had its chance too.
            await rt.start("Guarded", "witness", {"kind": "file", "path": str(target)})
            await until(lambda: fds()["inotify"] == base + 1)
            target.write_text("late")
            await wait_runtime_status(rt, "witness", "Finished")
            await rt.wait_idle()
            assert (await rt.show("f"))["data"]["ran"] == ["stop"]

    @pytest.mark.parametrize("on", ["created", "modified", "deleted"])
    async def test_edge_while_down_fires_at_restart(self, tmp_path: Path, on: str) -> None:
        """A create, write or delete that happened while the runtime was down fires on restart."""
        db, target = tmp_path / "wf.db", tmp_path / "f.txt"
        if on != "created":
            target.write_text("before")
        async with running(db) as rt:
            await rt.start("Guarded", "f", {"kind": "file", "path": str(target), "on": on})
            await wait_runtime_status(rt, "f", "Waiting")
        if on == "deleted":
            target.unlink()
        else:
            target.write_text("changed while down")
        async with running(db) as rt:
            shown = await wait_runtime_status(rt, "f", "Finished")
            assert shown["data"]["seen"]["got"] == {"path": str(target), "change": on}

    async def test_exists_true_at_restart_fires(self, tmp_path: Path) -> None:
        """A file created while the runtime was down fires `exists` as soon as it is re-armed."""
        db, target = tmp_path / "wf.db", tmp_path / "flag"
        async with running(db) as rt:
            await rt.start("Guarded", "f", {"kind": "file", "path": str(target), "on": "exists"})
            await wait_runtime_status(rt, "f", "Waiting")
        target.touch()
        async with running(db) as rt:
            shown = await wait_runtime_status(rt, "f", "Finished")
            assert shown["data"]["seen"]["got"] == {"path": str(target), "change": "exists"}


class TestSocketListen:
    """SocketListen, with real Unix and TCP sockets, in process."""

    async def test_fires_and_replies(self, tmp_path: Path) -> None:
        """The first line fires the case, the client gets the output, the socket file goes."""
        sock = tmp_path / "in.sock"
        base = fds()["socket"]
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Guarded", "s", {"kind": "socket", "path": str(sock)})
            await until(lambda: unix_listening(sock))
            assert await exchange(sock, line=b'{"a": 1}') == {"ok": True, "result": {"a": 1}}
            shown = await wait_runtime_status(rt, "s", "Finished")
            assert shown["data"]["seen"]["got"] == {"a": 1}
            await until(lambda: listen_tasks() == 0 and fds()["socket"] == base)
            assert not sock.exists() and not unix_bound(sock)

    async def test_listener_gone_when_signal_wins(self, tmp_path: Path) -> None:
        """A stop signal wins; the listener is closed and its socket file removed."""
        sock = tmp_path / "in.sock"
        base = fds()["socket"]
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Guarded", "s", {"kind": "socket", "path": str(sock)})
            await until(lambda: unix_listening(sock))
            await rt.send("s", "stop", "done")
            await wait_runtime_status(rt, "s", "Finished")
            assert len(rt.arms) == 0
            await until(lambda: listen_tasks() == 0 and fds()["socket"] == base)
            assert not sock.exists() and not unix_bound(sock)
            with pytest.raises(OSError):
                await anyio.connect_unix(sock)

    async def test_torn_down_while_binding(self, tmp_path: Path) -> None:
        """Waits torn down as soon as they are set up (mid-bind) leave no socket file."""
        socks = [tmp_path / f"s{n}.sock" for n in range(30)]
        async with running(tmp_path / "wf.db") as rt:
            for n, sock in enumerate(socks):
                await rt.start("Guarded", f"s{n}", {"kind": "socket", "path": str(sock)})
                await rt.send(f"s{n}", "stop", "now")
            await rt.wait_idle()
            await until(lambda: listen_tasks() == 0)
            assert [s.name for s in socks if s.exists() or unix_bound(s)] == []

    async def test_stopped_while_binding(self, tmp_path: Path) -> None:
        """A runtime stopped while its listeners bind leaves no socket file behind."""
        for attempt in range(3):
            socks = [tmp_path / f"{attempt}-{n}.sock" for n in range(20)]
            async with running(tmp_path / f"{attempt}.db") as rt:
                for n, sock in enumerate(socks):
                    await rt.start("Guarded", f"s{n}", {"kind": "socket", "path": str(sock)})
                await until(lambda: any(s.exists() for s in socks))  # noqa: B023 - used at once
            assert [s.name for s in socks if s.exists()] == []

    async def test_tcp_closed_when_signal_wins(self, tmp_path: Path) -> None:
        """A TCP listener fires when it is the winner and refuses connections once torn down."""
        port = free_port()
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Guarded", "a", {"kind": "socket", "port": port})
            assert await _tcp_exchange(port, b"plain text") == {"ok": True, "result": "plain text"}
            assert (await wait_runtime_status(rt, "a", "Finished"))["data"]["ran"] == ["it"]
            await rt.start("Guarded", "b", {"kind": "socket", "port": port})
            await _tcp_ready(port)
            await rt.send("b", "stop", "done")
            await wait_runtime_status(rt, "b", "Finished")
            await until(lambda: listen_tasks() == 0)
            with pytest.raises(OSError):
                await anyio.connect_tcp("127.0.0.1", port)

    async def test_reopened_after_restart(self, tmp_path: Path) -> None:
        """A clean stop removes the socket file; the restarted runtime listens again."""
        db, sock = tmp_path / "wf.db", tmp_path / "in.sock"
        async with running(db) as rt:
            await rt.start("Guarded", "s", {"kind": "socket", "path": str(sock)})
            await until(lambda: unix_listening(sock))
        assert not sock.exists()
        async with running(db) as rt:
            await until(lambda: unix_listening(sock))
            assert await exchange(sock, line=b"7") == {"ok": True, "result": 7}
            assert (await wait_runtime_status(rt, "s", "Finished"))["data"]["ran"] == ["it"]


async def _tcp_ready(port: int) -> None:
    """Wait (bounded) until something accepts on `port`; the probe sends nothing and leaves."""
    with anyio.fail_after(10):
        while True:
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.01)
                continue
            await stream.aclose()
            return


async def _tcp_exchange(port: int, line: bytes) -> Any:
    await _tcp_ready(port)
    return await exchange(port=port, line=line)


class TestSignal:
    """Signal, in process."""

    async def test_fires_and_is_gone_when_other_case_wins(self, tmp_path: Path) -> None:
        """A signal case replies; once the other case won, sending it is refused."""
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Guarded", "a")
            assert await rt.send("a", "it", [1]) == {"echo": [1]}
            assert (await wait_runtime_status(rt, "a", "Finished"))["data"]["ran"] == ["it"]
            await rt.start("Guarded", "b")
            await rt.send("b", "stop", "done")
            with pytest.raises(CallbackNotFound):
                await rt.send("b", "it", [2])
            assert (await wait_runtime_status(rt, "b", "Finished"))["data"]["ran"] == ["stop"]


class TestLateEvent:
    """An event that arrives while the other case is winning is refused; its listener still ends."""

    async def test_socket_message_during_stop(self, tmp_path: Path) -> None:
        """The client gets an error, the listener closes and its socket file is removed."""
        sock = tmp_path / "in.sock"
        base = fds()
        slow = {"kind": "socket", "path": str(sock), "stop_delay": 0.3}
        async with running(tmp_path / "wf.db") as rt, anyio.create_task_group() as tg:
            await rt.start("Guarded", "s", slow)
            await until(lambda: unix_listening(sock))
            await wait_runtime_status(rt, "s", "Waiting")  # no actor left from the start
            tg.start_soon(rt.send, "s", "stop", "first")
            await until(lambda: rt.scheduler.running("s"))  # stop is being handled
            reply = await exchange(sock, line=b"1")
            assert reply["ok"] is False and reply["error"]["code"] in ("not_found", "stale")
            assert (await wait_runtime_status(rt, "s", "Finished"))["data"]["ran"] == ["stop"]
            await until(lambda: listen_tasks() == 0 and fds() == base)
            assert not sock.exists() and not unix_bound(sock)

    async def test_file_event_during_stop(self, tmp_path: Path) -> None:
        """The file event is refused and the watch is closed, not retried."""
        target = tmp_path / "x"
        base = fds()
        slow = {"kind": "file", "path": str(target), "stop_delay": 0.3}
        async with running(tmp_path / "wf.db") as rt, anyio.create_task_group() as tg:
            await rt.start("Guarded", "f", slow)
            await until(lambda: fds()["inotify"] == base["inotify"] + 1)
            await wait_runtime_status(rt, "f", "Waiting")  # no actor left from the start
            tg.start_soon(rt.send, "f", "stop", "first")
            await until(lambda: rt.scheduler.running("f"))  # stop is being handled
            target.write_text("now")
            assert (await wait_runtime_status(rt, "f", "Finished"))["data"]["ran"] == ["stop"]
            await until(lambda: listen_tasks() == 0 and fds() == base)


class TestNoLeaks:
    """Torn-down waits leave no arm, task, descriptor or socket file behind."""

    async def test_everything_released(self, tmp_path: Path) -> None:
        """Waits of every kind, ended by a winning signal or a cancel, release everything."""
        base = fds()
        socks = [tmp_path / f"s{n}.sock" for n in range(4)]
        async with running(tmp_path / "wf.db") as rt:
            for n in range(4):
                await rt.start("Guarded", f"t{n}", {"kind": "timer", "after": 3600})
                await rt.start("Guarded", f"f{n}", {"kind": "file", "path": str(tmp_path / "x")})
                await rt.start("Guarded", f"s{n}", {"kind": "socket", "path": str(socks[n])})
                await rt.start("Guarded", f"g{n}", {"kind": "signal"})
            # The four file watches share the one inotify instance.
            await until(lambda: all(s.exists() for s in socks) and hub().subscribers() == 4)
            assert fds()["inotify"] == base["inotify"] + 1
            assert len(rt.arms) == 12 and listen_tasks() == 8
            for n in range(4):
                for kind in "tfsg":
                    if n % 2:
                        await rt.cancel(f"{kind}{n}")
                    else:
                        await rt.send(f"{kind}{n}", "stop", "done")
            await rt.wait_idle()
            assert len(rt.arms) == 0
            await until(lambda: listen_tasks() == 0 and fds() == base)
            assert not any(s.exists() for s in socks)
            statuses = Counter(w["status"] for w in await rt.list())
            assert statuses == {"Finished": 8, "Cancelled": 8}


class TestRace:
    """A Timer and a Signal race in the same Wait: exactly one case wins every round."""

    async def test_two_hundred_rounds(self, tmp_path: Path) -> None:
        """Each round a poke is sent around the timer's deadline; each round has one winner."""
        sent: dict[int, Any] = {}
        refused: list[int] = []
        pcs: set[int] = set()
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Race", "r", {"rounds": 200, "after": 0.005})
            with anyio.fail_after(30):
                while True:
                    await rt.wait_idle()
                    loaded = await rt.cache.load("r")
                    if loaded.state.status.value == "Finished":
                        break
                    wf = loaded.wf
                    assert isinstance(wf, Race)
                    n = wf.round
                    (pc,) = {
                        ev.req.pc
                        for t in loaded.state.threads
                        for ev in t.wait_events
                        if ev.req.name == "poke"
                    }
                    pcs.add(pc)
                    await anyio.sleep(
                        (n % 8) / 1000
                    )  # the race under test: 0..7 ms around the deadline
                    try:
                        sent[n] = await rt.send("r", "poke", None, pc=pc)
                    except (CallbackNotFound, StaleCallback):
                        refused.append(n)
            wf = (await rt.cache.load("r")).wf
            assert isinstance(wf, Race)
            winners = wf.winners
            assert len(rt.arms) == 0
        rounds = [int(w.split(":")[0]) for w in winners]
        assert rounds == list(range(200)), winners
        by_signal = {r for r, w in zip(rounds, winners, strict=True) if w.endswith("signal")}
        assert by_signal == set(sent)
        assert all(sent[r] == r for r in sent)
        assert not by_signal & set(refused)
        assert 0 not in pcs  # pc 0 would switch off the stale check

    async def test_socket_against_signal(self, tmp_path: Path) -> None:
        """A client and a poke race each round on one socket path; each round has one winner."""
        sock, rounds = tmp_path / "race.sock", 40
        replies: list[Any] = []
        pokes: list[Any] = []
        async with running(tmp_path / "wf.db") as rt:
            await rt.start("Race", "r", {"rounds": rounds, "path": str(sock)})
            with anyio.fail_after(30):
                while True:
                    await rt.wait_idle()
                    loaded = await rt.cache.load("r")
                    if loaded.state.status.value == "Finished":
                        break
                    (pc,) = {
                        ev.req.pc
                        for t in loaded.state.threads
                        for ev in t.wait_events
                        if ev.req.name == "poke"
                    }
                    n = len(replies)

                    async def poke() -> None:
                        await anyio.sleep((n % 4) / 1000)  # noqa: B023 - awaited in this round
                        try:
                            pokes.append(await rt.send("r", "poke", None, pc=pc))  # noqa: B023
                        except (CallbackNotFound, StaleCallback):
                            pokes.append(None)

                    # These delays are the race under test (poke and client 0..3 ms apart,
                    # either first), not a wait for something to happen.
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(poke)
                        await anyio.sleep((n // 4 % 4) / 1000)
                        replies.append(await exchange_retrying(sock, f"{n}".encode()))
            wf = (await rt.cache.load("r")).wf
            assert isinstance(wf, Race)
            await until(lambda: listen_tasks() == 0)
        assert [int(w.split(":")[0]) for w in wf.winners] == list(range(rounds))
        won_by_client = [r["result"] for r in replies if r is not None and r["ok"]]
        won_by_poke = [p for p in pokes if p is not None]
        kinds = Counter(w.split(":")[1] for w in wf.winners)
        assert kinds["socket"] == len(won_by_client) and kinds["signal"] == len(won_by_poke)
        refused = [r["error"]["code"] for r in replies if r is not None and not r["ok"]]
        assert set(refused) <= {"not_found", "stale"}
        assert not sock.exists()


async def exchange_retrying(sock: Path, line: bytes) -> Any:
    """Send one line to whichever listener holds `sock`; None if none answers for a while."""
    with anyio.move_on_after(0.5):  # the last round, won by a poke, leaves no listener
        while True:
            try:
                return await exchange(sock, line=line)
            except (OSError, json.JSONDecodeError, anyio.EndOfStream, anyio.BrokenResourceError):
                await anyio.sleep(0.005)
    return None
