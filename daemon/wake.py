"""Waking an event loop from another thread: one byte on a pipe of its own that the loop watches."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Callable


def _write_holding_the_gil() -> Callable[[int, bytes, int], int] | None:
    """Return libc's write(2) called without releasing the GIL, or None where there is none.

    os.write releases the GIL around the call: the loop it wakes takes the GIL at once and
    the waking thread then waits for the loop's whole turn to get it back, for the few
    lines it has left before it sleeps (two hand-offs of the GIL per wake-up, not one). A
    one-byte write to a non-blocking pipe never blocks, so it may hold the GIL.
    """
    try:
        fn = ctypes.PyDLL(None, use_errno=True).write
    except (OSError, AttributeError):  # no libc to load (not Linux or macOS)
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    fn.restype = ctypes.c_ssize_t
    written: Callable[[int, bytes, int], int] = fn
    return written


_raw_write = _write_holding_the_gil()


class LoopBell:
    """A pipe whose reading end the loop watches: a thread rings it, the loop runs `on_ring`.

    Ringing is one C call, where call_soon_threadsafe is eight Python calls, a Handle and a
    context copy, a send that gives the GIL up, and the loop's own self-pipe reader. The
    ringer rings once per batch it hands over (the loop takes every batch queued by then),
    so at most a byte or two are ever unread and the pipe never fills. `on_ring` calls
    `clear` before it takes what was handed over: a batch queued after that rings again.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_ring: Callable[[], None]) -> None:
        self._loop = loop
        # Ringing and closing exclude each other: a ring after the close must not write to
        # whatever file took the closed descriptor's number meanwhile.
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        loop.add_reader(self._r, on_ring)

    @property
    def closed(self) -> bool:
        """Tell whether the bell was closed."""
        return self._r < 0

    def ring(self) -> bool:
        """Wake the loop (from any thread); False if the bell is closed."""
        with self._lock:
            w = self._w
            if w < 0:
                return False
            if _raw_write is None:
                with contextlib.suppress(BlockingIOError):  # a byte unread: it wakes anyway
                    os.write(w, b"\0")
                return True
            return _raw_write(w, b"\0", 1) >= 0 or ctypes.get_errno() == errno.EAGAIN

    def clear(self) -> None:
        """Take the rings read so far (on the loop, in `on_ring`)."""
        try:  # noqa: SIM105 - contextlib.suppress costs three calls per wake-up
            os.read(self._r, 64)
        except OSError:  # BlockingIOError: read already, with the last batch; EBADF: closed
            pass

    def close(self) -> None:
        """Stop watching the pipe and close it; rings from now on do nothing."""
        with self._lock:
            r, w, self._r, self._w = self._r, self._w, -1, -1
        if r < 0:
            return
        if not self._loop.is_closed():  # a closed loop has no selector to take it off
            self._loop.remove_reader(r)
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)
