"""Tests for daemon.wake: a thread wakes the event loop through a pipe; a closed bell is inert."""

from __future__ import annotations

import asyncio
import os
import threading

import anyio

from daemon.wake import LoopBell


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class TestLoopBell:
    async def test_a_ring_from_another_thread_runs_the_callback_on_the_loop(self) -> None:
        """The callback runs on the loop's thread, once per ring taken with `clear`."""
        loop = asyncio.get_running_loop()
        seen: list[int] = []
        rung = asyncio.Event()

        def on_ring() -> None:
            bell.clear()
            seen.append(threading.get_ident())
            rung.set()

        bell = LoopBell(loop, on_ring)
        try:
            t = threading.Thread(target=bell.ring)
            t.start()
            t.join()
            with anyio.fail_after(5):
                await rung.wait()
            assert seen == [threading.get_ident()]
        finally:
            bell.close()

    async def test_rings_before_the_loop_looks_wake_it_once(self) -> None:
        """Rings that pile up while the loop is busy are taken by one `clear`."""
        loop = asyncio.get_running_loop()
        calls = 0
        done = asyncio.Event()

        def on_ring() -> None:
            nonlocal calls
            bell.clear()
            calls += 1
            done.set()

        bell = LoopBell(loop, on_ring)
        try:
            assert all(bell.ring() for _ in range(5))
            with anyio.fail_after(5):
                await done.wait()
            # Each turn of the loop looks for I/O: a byte left in the pipe would call it again.
            for _ in range(3):
                await asyncio.sleep(0)
            assert calls == 1
        finally:
            bell.close()

    async def test_a_closed_bell_rings_nothing_and_gives_its_descriptors_back(self) -> None:
        """After close a ring says False, writes nowhere, and no descriptor is left open."""
        loop = asyncio.get_running_loop()
        before = _open_fds()
        bell = LoopBell(loop, lambda: None)
        assert _open_fds() == before + 2
        bell.close()
        bell.close()  # twice is harmless
        assert bell.closed
        assert _open_fds() == before
        # The descriptor numbers may be someone else's now: a late ring must not touch them.
        r, w = os.pipe()
        try:
            assert bell.ring() is False
            os.set_blocking(r, False)
            try:
                got = os.read(r, 1)
            except BlockingIOError:
                got = b""
            assert got == b""
        finally:
            os.close(r)
            os.close(w)

    def test_a_bell_of_a_closed_loop_closes(self) -> None:
        """Closing after the loop closed (the writer's last word) closes the pipe, no error."""
        before = _open_fds()
        loop = asyncio.new_event_loop()
        bell = LoopBell(loop, lambda: None)
        loop.close()
        bell.close()
        assert _open_fds() == before
        assert bell.ring() is False
