"""Tests for daemon.log: JSON lines, stdlib routing, live level changes and the LogHub."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from daemon.service import log as log_module
from daemon.service import logwriter
from daemon.service.log import LogHub, close_logging, configure_logging, flush_logs, set_level
from tests.helpers.wait import until

# Every test here configures logging; the fixture (tests/conftest.py) undoes it afterwards.
pytestmark = pytest.mark.usefixtures("restore_logging")


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    """Parse every line written so far as one JSON object."""
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def take(records: AsyncIterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Read `n` records, failing instead of hanging if they never come."""
    out = []
    with anyio.fail_after(5):
        for _ in range(n):
            out.append(await records.__anext__())
    return out


def log_on_a_loop_closed_at_once(event: str) -> None:
    """Log `event` on a loop closed right after, before its writer kick (2 ms on) is due."""

    async def main() -> None:
        structlog.get_logger().info(event)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


class TestOutput:
    def test_json_lines_with_context(self) -> None:
        """Each event is one JSON line with timestamp, level, event and bound context."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        with structlog.contextvars.bound_contextvars(workflow_id="w1"):
            structlog.get_logger().info("step_done", step="a", path=Path("/x"), tags={1})
        [record] = lines(out)
        assert record["event"] == "step_done"
        assert record["level"] == "info"
        assert record["workflow_id"] == "w1"
        assert record["step"] == "a"
        assert record["path"] == "/x"
        assert record["timestamp"].endswith("Z")

    def test_fields_in_structlog_order(self) -> None:
        """A line holds bound values, keywords, event, contextvars, timestamp, level, in order."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        log = structlog.get_logger().bind(node="n1", step="bound")
        with structlog.contextvars.bound_contextvars(workflow_id="w1", step="ctx"):
            log.info("step_done", step="a", duration_ms=0.5)
        [record] = lines(out)
        assert list(record) == [
            "node", "step", "duration_ms", "event", "workflow_id", "timestamp", "level"
        ]  # fmt: skip
        assert record["step"] == "a"  # the call's keyword wins over bound and context values

    def test_context_is_taken_at_the_call(self) -> None:
        """The record keeps the contextvars bound when it was logged, not when it is written."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        log = structlog.get_logger()

        async def main() -> None:
            with structlog.contextvars.bound_contextvars(workflow_id="w1", workflow="A"):
                log.info("first")
            structlog.contextvars.bind_contextvars(workflow_id="w2")
            log.info("second")
            assert out.getvalue() == ""  # both still queued: rendered after the rebinding
            structlog.contextvars.unbind_contextvars("workflow_id")
            flush_logs()

        anyio.run(main)
        first, second = lines(out)
        assert (first["workflow_id"], first["workflow"]) == ("w1", "A")
        assert second["workflow_id"] == "w2" and "workflow" not in second

    def test_auto_is_json_when_not_a_tty(self) -> None:
        """The auto format writes JSON to a stream that is not a terminal."""
        out = io.StringIO()
        configure_logging("info", "auto", out, cache=False)
        structlog.get_logger().warning("disk_full")
        assert lines(out)[0]["level"] == "warning"

    def test_console_format(self) -> None:
        """The console format writes readable, non-JSON lines."""
        out = io.StringIO()
        configure_logging("info", "console", out, cache=False)
        structlog.get_logger().info("step_done", step="a")
        text = out.getvalue()
        assert "step_done" in text
        assert "step=a" in text
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)

    def test_exception_is_structured(self) -> None:
        """log.exception renders the traceback as structured data."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        try:
            raise ValueError("bad")
        except ValueError:
            structlog.get_logger().exception("step_failed")
        [record] = lines(out)
        assert record["level"] == "error"
        assert record["exception"][0]["exc_type"] == "ValueError"

    def test_stdlib_logs_are_json(self) -> None:
        """Records from stdlib loggers become JSON lines with the logger name and context."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        with structlog.contextvars.bound_contextvars(workflow_id="w2"):
            logging.getLogger("asyncio").warning("slow callback %s", 7)
        [record] = lines(out)
        assert record["event"] == "slow callback 7"
        assert record["level"] == "warning"
        assert record["logger"] == "asyncio"
        assert record["workflow_id"] == "w2"
        assert "timestamp" in record

    def test_reconfigure_does_not_duplicate(self) -> None:
        """Configuring twice leaves one stdlib handler, writing to the new stream."""
        first, second = io.StringIO(), io.StringIO()
        configure_logging("info", "json", first, cache=False)
        configure_logging("info", "json", second, cache=False)
        logging.getLogger("x").warning("once")
        assert first.getvalue() == ""
        assert len(lines(second)) == 1


class TestLevel:
    def test_level_filters(self) -> None:
        """Events under the configured level are dropped, for structlog and stdlib alike."""
        out = io.StringIO()
        configure_logging("warning", "json", out, cache=False)
        structlog.get_logger().info("hidden")
        logging.getLogger("x").info("hidden too")
        structlog.get_logger().error("shown")
        assert [r["event"] for r in lines(out)] == ["shown"]

    def test_set_level_reaches_cached_loggers(self) -> None:
        """set_level changes the level even for a logger cached before the change."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=True)
        log = structlog.get_logger()
        log.debug("before")
        log.info("cached")
        set_level("debug")
        log.debug("after")
        logging.getLogger("x").debug("stdlib after")
        set_level("error")
        log.warning("muted")
        assert [r["event"] for r in lines(out)] == ["cached", "after", "stdlib after"]

    def test_unknown_level(self) -> None:
        """An unknown level name is refused."""
        with pytest.raises(ValueError, match="verbose"):
            set_level("verbose")


class TestLogHub:
    async def test_buffered_then_live(self) -> None:
        """A subscriber first gets the buffered records, then new ones as they are logged."""
        hub = LogHub(size=2)
        configure_logging("info", "json", io.StringIO(), cache=False, hub=hub)
        log = structlog.get_logger()
        for n in range(3):
            log.info("old", n=n)
        async with hub.subscribe() as records:
            assert [r["n"] for r in await take(records, 2)] == [1, 2]
            log.info("new", n=3, path=Path("/p"))
            [record] = await take(records, 1)
        assert record["event"] == "new"
        assert record["path"] == "/p"
        assert record["level"] == "info"
        assert "timestamp" in record

    async def test_filters_by_workflow(self) -> None:
        """Subscribing with a workflow id yields only that workflow's records."""
        hub = LogHub()
        configure_logging("info", "json", io.StringIO(), cache=False, hub=hub)
        log = structlog.get_logger()
        log.info("a", workflow_id="w1")
        log.info("b", workflow_id="w2")
        async with hub.subscribe("w1") as records:
            with structlog.contextvars.bound_contextvars(workflow_id="w2"):
                log.info("c")
            with structlog.contextvars.bound_contextvars(workflow_id="w1"):
                log.info("d")
            assert [r["event"] for r in await take(records, 2)] == ["a", "d"]

    async def test_stdlib_records_from_a_thread(self) -> None:
        """Records logged from another thread wake the subscriber."""
        hub = LogHub()
        configure_logging("info", "json", io.StringIO(), cache=False, hub=hub)
        async with hub.subscribe() as records:
            thread = threading.Thread(target=logging.getLogger("aiosqlite").warning, args=("t",))
            thread.start()
            [record] = await take(records, 1)
            thread.join()
        assert record == {**record, "event": "t", "logger": "aiosqlite", "level": "warning"}

    async def test_exceptions_are_jsonable(self) -> None:
        """A record with a traceback reaches subscribers as plain JSON data in console mode too."""
        hub = LogHub()
        configure_logging("info", "console", io.StringIO(), cache=False, hub=hub)
        try:
            raise KeyError("k")
        except KeyError:
            structlog.get_logger().exception("boom")
        async with hub.subscribe() as records:
            [record] = await take(records, 1)
        assert "KeyError" in record["exception"]
        json.dumps(record)

    async def test_slow_subscriber_does_not_block(self) -> None:
        """A subscriber that does not read loses records, counted, while logging goes on."""
        hub = LogHub(size=10, subscriber_limit=3)
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False, hub=hub)
        log = structlog.get_logger()
        async with hub.subscribe() as slow, hub.subscribe() as fast:
            for n in range(3):
                log.info("e", n=n)
                assert (await take(fast, 1))[0]["n"] == n
            for n in range(3, 50):
                log.info("e", n=n)
            flush_logs()
            assert len(lines(out)) == 50
            got = await take(slow, 4)
            assert [r.get("n") for r in got[:3]] == [0, 1, 2]
            assert got[3] == {"event": "log_records_dropped", "level": "warning", "count": 47}
            log.info("e", n=50)
            assert (await take(slow, 1))[0]["n"] == 50
            assert [r["n"] for r in await take(fast, 3)] == [3, 4, 5]

    async def test_unsubscribe_stops_delivery(self) -> None:
        """After the subscription closes, publishing no longer queues records for it."""
        hub = LogHub()
        async with hub.subscribe() as records:
            hub.publish({"event": "x"})
            await take(records, 1)
        hub.publish({"event": "y"})
        assert not hub._subs


class _CountingStream(io.StringIO):
    """A stream that counts its write calls."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


class TestBatching:
    async def test_one_write_per_loop_turn(self) -> None:
        """Records logged in one loop turn reach the stream together, in one write, in order."""
        out = _CountingStream()
        configure_logging("info", "json", out, cache=False)
        log = structlog.get_logger()
        for n in range(100):
            log.info("e", n=n)
        assert out.writes == 0  # nothing rendered or written on the loop yet
        await until(lambda: len(lines(out)) == 100, limit_s=5)
        assert [r["n"] for r in lines(out)] == list(range(100))
        assert out.writes == 1

    async def test_no_timer_and_one_wake_per_turn_at_most(self) -> None:
        """A turn's records wake the writer once at most, through no loop timer; idle, it sleeps."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        batcher = log_module._batcher[0]
        loop = asyncio.get_running_loop()
        real, timers = loop.call_later, []

        def counted(delay: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
            if getattr(callback, "__self__", None) is batcher:
                timers.append(delay)
            return real(delay, callback, *args, **kw)

        loop.call_later = counted  # type: ignore[method-assign,assignment]
        try:
            log = structlog.get_logger()
            for turn in range(10):
                for n in range(3):
                    log.info("e", turn=turn, n=n)
                written = 3 * (turn + 1)
                await until(lambda: len(lines(out)) == written, limit_s=5)  # noqa: B023
        finally:
            del loop.call_later
        assert timers == []
        woken = batcher.wakes
        assert 1 <= woken <= 10
        for _ in range(20):  # turns with nothing logged wake nobody
            await asyncio.sleep(0)
        assert batcher.wakes == woken
        assert [(r["turn"], r["n"]) for r in lines(out)] == [
            (t, n) for t in range(10) for n in range(3)
        ]

    async def test_a_woken_writer_lingers_and_takes_the_next_turns_along(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Records of the turns after the one that woke the writer share its wake and write."""
        gate = threading.Event()
        lingered: list[float] = []

        def linger(seconds: float) -> None:
            lingered.append(seconds)
            gate.wait(10)  # the test's turns run meanwhile; no clock decides what rides along

        monkeypatch.setattr(logwriter, "_sleep", linger)
        out = _CountingStream()
        configure_logging("info", "json", out, cache=False)
        batcher = log_module._batcher[0]
        await until(lambda: batcher._idle, limit_s=5)  # asleep: the first record wakes it
        log = structlog.get_logger()
        log.info("e", turn=0)
        await until(lambda: bool(lingered), limit_s=5)  # woken, and lingering
        for turn in range(1, 6):
            await asyncio.sleep(0)
            log.info("e", turn=turn)
        await asyncio.sleep(0)
        assert batcher.wakes == 1 and out.writes == 0
        gate.set()
        await until(lambda: len(lines(out)) == 6, limit_s=5)
        assert out.writes == 1 and batcher.wakes == 1
        assert [r["turn"] for r in lines(out)] == list(range(6))
        assert lingered == [logwriter.LINGER_S]

    async def test_records_for_an_awake_writer_schedule_no_kick(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """While the writer is awake (lingering), a turn's records cost no loop callback."""
        gate = threading.Event()
        monkeypatch.setattr(logwriter, "_sleep", lambda seconds: gate.wait(10))
        out = _CountingStream()
        configure_logging("info", "json", out, cache=False)
        batcher = log_module._batcher[0]
        await until(lambda: batcher._idle, limit_s=5)
        loop = asyncio.get_running_loop()
        real, kicks = loop.call_soon, []

        def counted(callback: Any, *args: Any, **kw: Any) -> asyncio.Handle:
            if getattr(callback, "__self__", None) is batcher:
                kicks.append(callback)
            return real(callback, *args, **kw)

        log = structlog.get_logger()
        try:
            loop.call_soon = counted  # type: ignore[method-assign,assignment]
            log.info("e", turn=0)  # asleep: this one kicks it
            await until(lambda: batcher.wakes == 1, limit_s=5)
            assert len(kicks) == 1
            for turn in range(1, 6):
                log.info("e", turn=turn)
                await asyncio.sleep(0)
            assert len(kicks) == 1 and out.writes == 0
        finally:
            del loop.call_soon
            gate.set()
        await until(lambda: len(lines(out)) == 6, limit_s=5)
        assert [r["turn"] for r in lines(out)] == list(range(6))
        assert batcher.wakes == 1
        await until(lambda: batcher._idle, limit_s=5)  # asleep again: the next record kicks
        log.info("e", turn=6)
        await until(lambda: len(lines(out)) == 7, limit_s=5)
        assert batcher.wakes == 2

    async def test_an_error_does_not_wait_for_the_linger(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A lingering writer holds no error back: it is written at once, after the queue."""
        gate = threading.Event()
        monkeypatch.setattr(logwriter, "_sleep", lambda seconds: gate.wait(10))
        out = _CountingStream()
        configure_logging("info", "json", out, cache=False)
        batcher = log_module._batcher[0]
        await until(lambda: batcher._idle, limit_s=5)
        log = structlog.get_logger()
        try:
            log.info("before")
            await until(lambda: batcher.wakes == 1, limit_s=5)
            log.error("broke")
            assert [r["event"] for r in lines(out)] == ["before", "broke"]
        finally:
            gate.set()

    async def test_errors_are_written_at_once_after_what_was_queued(self) -> None:
        """An error record is on the stream when the call returns, after the records before it."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        log = structlog.get_logger()
        log.info("before")
        log.error("broke", n=1)
        assert [r["event"] for r in lines(out)] == ["before", "broke"]

    def test_a_new_loop_is_not_left_waiting_on_a_stopped_one(self) -> None:
        """A loop that stops before its batch is written leaves no record of the next loop queued."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        log_on_a_loop_closed_at_once("on_first")

        async def second() -> None:
            structlog.get_logger().info("on_second")
            await until(lambda: len(lines(out)) == 2, limit_s=5)

        anyio.run(second)
        assert [r["event"] for r in lines(out)] == ["on_first", "on_second"]

    def test_off_the_loop_after_it_stopped_is_written_at_once(self) -> None:
        """A record logged once the loop is gone is written at once, after the loop's own."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        log_on_a_loop_closed_at_once("in_loop")
        structlog.get_logger().info("after_loop")
        assert [r["event"] for r in lines(out)] == ["in_loop", "after_loop"]

    async def test_close_writes_what_is_queued(self) -> None:
        """A clean stop (close_logging, also run at exit) loses no queued record."""
        out = io.StringIO()
        configure_logging("info", "json", out, cache=False)
        for n in range(10):
            structlog.get_logger().info("e", n=n)
        close_logging()
        assert len(lines(out)) == 10
        structlog.get_logger().info("after")  # written at once once the writer is gone
        assert lines(out)[-1]["event"] == "after"

    async def test_levels_are_filtered_before_any_processor(self) -> None:
        """A record under the level never reaches a processor (nothing is rendered for it)."""
        seen: list[str] = []
        configure_logging("info", "json", io.StringIO(), cache=False)

        def spy(_: Any, __: str, event_dict: Any) -> Any:
            seen.append(event_dict["event"])
            return event_dict

        config = structlog.get_config()
        structlog.configure(processors=[spy, *config["processors"]])
        structlog.get_logger().debug("hidden")
        structlog.get_logger().info("shown")
        assert seen == ["shown"]
