"""Garbage-collector pauses: timed per generation, long ones logged, a summary at the stop."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

#: A collection that holds the loop this long is kept for the log (`gc_pause`).
SLOW_MS = 10.0
#: Slow pauses kept until the next `take_slow`, at most (the oldest are dropped).
KEEP_SLOW = 100


class GcWatch:
    """Times every collection of the cyclic GC through `gc.callbacks`."""

    def __init__(self, slow_ms: float = SLOW_MS) -> None:
        self.slow_ms = slow_ms
        self.collections = [0, 0, 0]  #: per generation
        self.total_ms = [0.0, 0.0, 0.0]
        self.longest_ms = [0.0, 0.0, 0.0]
        #: The same in the collecting thread's CPU time: on a loaded machine the wall pause
        #: includes waiting for a core, this is the collector's own work.
        self.cpu_total_ms = [0.0, 0.0, 0.0]
        self.cpu_longest_ms = [0.0, 0.0, 0.0]
        self._began = 0.0
        self._began_cpu = 0.0
        #: (Unix time, generation, ms, collected) of each slow pause not yet taken.
        self.slow: deque[tuple[float, int, float, int]] = deque(maxlen=KEEP_SLOW)

    def install(self) -> None:
        """Start timing collections (once; a second call does nothing)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        """Stop timing collections."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began, self._began_cpu = time.perf_counter(), time.thread_time()
            return
        took_ms = (time.perf_counter() - self._began) * 1000
        cpu_ms = (time.thread_time() - self._began_cpu) * 1000
        gen = int(info.get("generation", 2))
        self.cpu_total_ms[gen] += cpu_ms
        self.cpu_longest_ms[gen] = max(self.cpu_longest_ms[gen], cpu_ms)
        self.collections[gen] += 1
        self.total_ms[gen] += took_ms
        self.longest_ms[gen] = max(self.longest_ms[gen], took_ms)
        if took_ms >= self.slow_ms:
            # Kept, not logged: a collection runs on whichever thread allocated, the log
            # writer's own included, which must not re-enter the log.
            self.slow.append((time.time(), gen, took_ms, int(info.get("collected", 0))))

    def take_slow(self) -> list[tuple[float, int, float, int]]:
        """Return the slow pauses kept since the last call, and forget them."""
        taken = []
        while self.slow:
            taken.append(self.slow.popleft())
        return taken

    def summary(self) -> dict[str, Any]:
        """Return the counts, total and longest pause (ms) of each generation so far."""
        return {
            "collections": list(self.collections),
            "total_ms": [round(t, 2) for t in self.total_ms],
            "longest_ms": [round(t, 2) for t in self.longest_ms],
            "cpu_total_ms": [round(t, 2) for t in self.cpu_total_ms],
            "cpu_longest_ms": [round(t, 2) for t in self.cpu_longest_ms],
            "frozen": gc.get_freeze_count(),
            "threshold": list(gc.get_threshold()),
        }
