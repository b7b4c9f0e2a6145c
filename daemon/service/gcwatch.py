"""Garbage-collector pauses: timed per generation, long ones logged, a summary at the stop.

Also the daemon's full collections, which `QuietCollector` runs at quiet moments.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

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
        #: Objects each generation's collections found unreachable (and freed).
        self.collected = [0, 0, 0]
        #: The thresholds `summary` reports, if not CPython's own (`QuietCollector` runs the
        #: full collections: CPython's third figure is then out of reach).
        self.threshold: tuple[int, ...] | None = None
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
        self.collected[gen] += int(info.get("collected", 0))
        self.total_ms[gen] += took_ms
        self.longest_ms[gen] = max(self.longest_ms[gen], took_ms)
        if took_ms >= self.slow_ms:
            # Kept, not logged: a collection runs on whichever thread allocated, the log
            # writer's own included, which must not re-enter the log.
            self.slow.append((time.time(), gen, took_ms, int(info.get("collected", 0))))

    def collect_rest(self) -> int:
        """Run a full collection untimed (the stop's), counting what it frees in `collected`.

        Untimed, so that the pause figures stay those of the daemon's life; installed again
        afterwards if it was.
        """
        installed = self._callback in gc.callbacks
        self.uninstall()
        try:
            found = gc.collect()
        finally:
            if installed:
                self.install()
        self.collected[2] += found
        return found

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
            "threshold": list(self.threshold or gc.get_threshold()),
            "collected": list(self.collected),
        }


#: CPython's third threshold while `QuietCollector` runs the full collections: never reached.
NEVER = 1_000_000_000
#: How often (seconds) the collector looks whether a full collection is due and the loop quiet.
LOOK_S = 0.25
#: The loop is quiet when it used less than this share of its thread's time since the last look.
QUIET_SHARE = 0.05
#: A due full collection waits for a quiet moment until it is this many times overdue.
FORCE_FACTOR = 4
#: Nothing may be due (a timer, a deadline) sooner than this, or twice the last full pause.
LEAD_S = 0.05


class QuietCollector:
    """Runs the full collections when the loop is quiet and no timer is due soon.

    CPython starts a full collection once `due_after` middle ones have run (its third
    threshold), wherever that count lands: often in the middle of a burst, where it holds the
    loop for as long as it takes to scan the whole heap. Here CPython's own figure is set out of
    reach and `look` (called every LOOK_S on the loop) runs the full collection instead, once
    it is due, the loop used under QUIET_SHARE of its time since the last look and no workflow
    is busy. Memory stays
    bounded under a load that never lets up: a collection FORCE_FACTOR times overdue runs
    anyway. (A time-based spacing was tried: under garbage that keeps coming it let each
    collection grow, and the pause with it.)

    A quiet moment also empties the young generations (a middle collection) once they hold
    anything worth it, so that a burst after a wave of starts does not begin with a middle
    collection of everything the starts made.
    """

    def __init__(
        self,
        *,
        due_after: int,
        young_after: int = 1000,
        until_due: Callable[[], float] = lambda: math.inf,
        collect: Callable[[int], int] = gc.collect,
        counts: Callable[[], tuple[int, int, int]] = gc.get_count,
        cpu: Callable[[], float] = time.thread_time,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        #: `young_after`: the youngest generation's count worth a quiet middle collection.
        self.due_after, self.young_after, self._collect = max(due_after, 1), young_after, collect
        #: Returns the seconds until the next timer or deadline is due (set by the daemon).
        self.until_due = until_due
        #: Returns how many workflows are busy now (set by the daemon): quiet means none.
        self.in_flight: Callable[[], int] = lambda: 0
        self._counts, self._cpu, self._now = counts, cpu, now
        self._looked, self._looked_cpu = now(), cpu()
        #: How long the last middle and full collection took (seconds).
        self._last_s = {1: 0.0, 2: 0.0}
        #: Full collections run: at a quiet moment, and forced (overdue under load).
        self.quiet_runs = self.forced_runs = 0
        #: Middle collections run at a quiet moment.
        self.young_runs = 0

    def look(self) -> Collection | None:
        """Run a full collection if one is due and the loop is quiet (or it is overdue).

        Quiet and no full one due, it empties the young generations if they hold enough.
        """
        now, cpu = self._now(), self._cpu()
        busy = (cpu - self._looked_cpu) / max(now - self._looked, 1e-6)
        self._looked, self._looked_cpu = now, cpu
        young, middle, full = self._counts()
        # The share looks back; the work in flight tells of a burst that just began.
        quiet = busy < QUIET_SHARE and not self.in_flight()
        if full >= self.due_after:
            forced = full >= self.due_after * FORCE_FACTOR
            if not (forced or (quiet and self._clear(2))):
                return None
            ran = self._run(2, busy, forced=not (quiet and self._clear(2)))
            if ran.forced:
                self.forced_runs += 1
            else:
                self.quiet_runs += 1
            return ran
        if quiet and (middle > 0 or young >= self.young_after) and self._clear(1):
            self.young_runs += 1
            return self._run(1, busy, forced=False)
        return None

    def _clear(self, generation: int) -> bool:
        """Tell whether nothing is due before twice this generation's last pause (or LEAD_S)."""
        return self.until_due() > max(LEAD_S, 2 * self._last_s[generation])

    def _run(self, generation: int, busy: float, *, forced: bool) -> Collection:
        began = self._now()
        collected = self._collect(generation)
        ended = self._now()
        self._last_s[generation] = ended - began
        # The collection's own CPU is not the next look's business.
        self._looked, self._looked_cpu = ended, self._cpu()
        return Collection(generation, (ended - began) * 1000, collected, forced, busy)


class Collection(NamedTuple):
    """One collection `QuietCollector` ran (a full one is logged as `gc_full`)."""

    generation: int
    ms: float
    collected: int
    #: Run although the loop was busy: it was FORCE_FACTOR times overdue.
    forced: bool
    #: The loop's share of its thread's time since the look before.
    busy: float
