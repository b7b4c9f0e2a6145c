"""OS thread names: the daemon's threads named in /proc, so their CPU can be told apart."""

from __future__ import annotations

import contextlib
import ctypes
import sys

#: prctl's PR_SET_NAME; the kernel keeps 15 bytes of the name.
_PR_SET_NAME = 15
_libc: list[ctypes.CDLL] = []


def name_os_thread(name: str) -> None:
    """Name the calling thread in /proc/PID/task/TID/comm (Linux; elsewhere nothing happens).

    Python 3.11 names threads for `threading` only; `top -H`, schedstat readers and the
    benchmarks see the kernel's name.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        if not _libc:
            _libc.append(ctypes.CDLL(None, use_errno=True))
        _libc[0].prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
