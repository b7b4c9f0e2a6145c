"""Tests for daemon.notify: sd_notify messages reach a real datagram socket."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import structlog

from daemon.service.notify import Notifier, watchdog_loop


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for systemd's notify socket."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)  # a missing message fails the test instead of hanging
    yield sock, path
    sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


class TestMessages:
    def test_messages(self, listener: tuple[socket.socket, str]) -> None:
        """Each method sends its sd_notify line."""
        sock, path = listener
        with Notifier(path) as notifier:
            assert notifier.ready()
            assert recv(sock) == "READY=1"
            notifier.status("running 3\nworkflows")
            assert recv(sock) == "STATUS=running 3 workflows"
            notifier.stopping()
            assert recv(sock) == "STOPPING=1"
            notifier.watchdog()
            assert recv(sock) == "WATCHDOG=1"
        assert notifier._sock is None
        assert notifier.ready()
        assert recv(sock) == "READY=1"  # a send after close reopens the socket
        notifier.close()

    def test_reloading_carries_monotonic_time(self, listener: tuple[socket.socket, str]) -> None:
        """RELOADING=1 comes with MONOTONIC_USEC read from CLOCK_MONOTONIC."""
        sock, path = listener
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        with Notifier(path) as notifier:
            notifier.reloading()
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        first, second = recv(sock).split("\n")
        assert first == "RELOADING=1"
        key, value = second.split("=")
        assert key == "MONOTONIC_USEC"
        assert before <= int(value) <= after

    def test_abstract_socket(self) -> None:
        """An address starting with @ names an abstract socket."""
        name = f"workflowd-test-{uuid.uuid4().hex}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind("\0" + name)
            sock.settimeout(5)
            with Notifier.from_env({"NOTIFY_SOCKET": "@" + name}) as notifier:
                notifier.ready()
            assert recv(sock) == "READY=1"

    def test_no_socket_is_a_no_op(self) -> None:
        """Without $NOTIFY_SOCKET nothing is sent and nothing fails."""
        notifier = Notifier.from_env({"WATCHDOG_USEC": "1000000"})
        assert not notifier.ready()
        assert notifier.watchdog_interval() is None

    def test_send_error_is_logged_not_raised(self, tmp_path: Path) -> None:
        """A send to a socket that is gone logs a warning and returns False."""
        with (
            Notifier(str(tmp_path / "gone.sock")) as notifier,
            structlog.testing.capture_logs() as logs,
        ):
            assert not notifier.ready()
        assert logs[0]["event"] == "sd_notify_failed"
        assert logs[0]["log_level"] == "warning"

    def test_unset_removes_variables(self) -> None:
        """from_env(unset=True) keeps children from inheriting the notify variables."""
        env = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "10", "WATCHDOG_PID": "1", "PATH": "/bin"}
        notifier = Notifier.from_env(env, unset=True)
        assert env == {"PATH": "/bin"}
        assert notifier.address == "/x"


class TestWatchdog:
    @pytest.mark.parametrize(
        ("env", "expected"),
        [
            ({"WATCHDOG_USEC": "30000000"}, 15.0),
            ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
            ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
            ({"WATCHDOG_USEC": "0"}, None),
            ({"WATCHDOG_USEC": "soon"}, None),
            ({}, None),
        ],
    )
    def test_interval(self, env: dict[str, str], expected: float | None) -> None:
        """The interval is half of $WATCHDOG_USEC, and only when the watchdog is meant for us."""
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "/run/notify", **env})
        assert notifier.watchdog_interval() == expected

    async def test_loop_pings(self, listener: tuple[socket.socket, str]) -> None:
        """watchdog_loop keeps sending WATCHDOG=1 until cancelled."""
        sock, path = listener
        sock.setblocking(False)
        async with anyio.create_task_group() as tg:
            notifier = Notifier(path, watchdog_usec=2000)
            tg.start_soon(watchdog_loop, notifier)
            with anyio.fail_after(5):
                for _ in range(3):
                    await anyio.wait_readable(sock)
                    assert recv(sock) == "WATCHDOG=1"
            tg.cancel_scope.cancel()
        notifier.close()

    async def test_loop_returns_without_watchdog(self) -> None:
        """Without a watchdog the loop ends at once."""
        with anyio.fail_after(5):
            await watchdog_loop(Notifier("/run/notify"))
