"""Tests for daemon.service.gcwatch: each collection timed, slow ones kept for the log."""

from __future__ import annotations

import gc

from daemon.service.gcwatch import (
    FORCE_FACTOR,
    LEAD_S,
    LOOK_S,
    NEVER,
    GcWatch,
    QuietCollector,
)


class TestGcWatch:
    def test_times_each_collection_by_generation(self) -> None:
        """gc.collect(1) and gc.collect(2) are counted under their generations."""
        watch = GcWatch(slow_ms=0.0)
        watch.install()
        try:
            gc.collect(1)
            gc.collect(2)
        finally:
            watch.uninstall()
        assert watch.collections[1] >= 1 and watch.collections[2] >= 1
        assert watch.longest_ms[2] > 0 and watch.total_ms[2] >= watch.longest_ms[2]
        slow = watch.take_slow()  # every pause is "slow" at 0 ms
        assert {gen for _, gen, _, _ in slow} >= {1, 2}
        assert watch.take_slow() == []
        summary = watch.summary()
        assert summary["collections"] == watch.collections
        assert len(summary["cpu_longest_ms"]) == 3

    def test_the_rest_is_collected_untimed_and_counted(self) -> None:
        """collect_rest frees old cycles, counts them in `collected`, and times nothing."""
        watch = GcWatch()
        watch.install()
        try:
            for _ in range(100):
                cycle: list[object] = []
                cycle.append(cycle)
            del cycle
            found = watch.collect_rest()
            assert found >= 100 and watch.collected[2] >= 100
            assert watch.collections[2] == 0 and watch.summary()["collected"][2] >= 100
            assert watch._callback in gc.callbacks  # still installed
        finally:
            watch.uninstall()

    def test_uninstalled_counts_nothing(self) -> None:
        """Once uninstalled, collections are not timed any more."""
        watch = GcWatch()
        watch.install()
        watch.install()  # a second install does not double-count
        watch.uninstall()
        gc.collect()
        assert watch.collections == [0, 0, 0]


class _Loop:
    """A fake loop thread for QuietCollector: its clock, its CPU time and the gc counts."""

    def __init__(self) -> None:
        self.now, self.cpu, self.due_in = 0.0, 0.0, 60.0
        self.counts = [0, 0, 0]
        self.collections: list[tuple[int, float]] = []
        #: How long a collection takes (seconds of the fake clock).
        self.pause_s = 0.01

    def collect(self, generation: int) -> int:
        self.collections.append((generation, self.now))
        self.now += self.pause_s
        self.cpu += self.pause_s
        for g in range(generation + 1):
            self.counts[g] = 0
        return 7

    def run(self, seconds: float, busy: float, collector: QuietCollector) -> None:
        """Advance `seconds` in looks LOOK_S apart, the loop busy for `busy` of the time."""
        for _ in range(round(seconds / LOOK_S)):
            self.now += LOOK_S
            self.cpu += LOOK_S * busy
            collector.look()

    def full(self) -> list[float]:
        return [at for g, at in self.collections if g == 2]


def _collector(loop: _Loop, due_after: int = 50) -> QuietCollector:
    return QuietCollector(
        due_after=due_after,
        young_after=1000,
        until_due=lambda: loop.due_in,
        collect=loop.collect,
        counts=lambda: (loop.counts[0], loop.counts[1], loop.counts[2]),
        cpu=lambda: loop.cpu,
        now=lambda: loop.now,
    )


class TestQuietCollector:
    def test_a_due_collection_waits_for_a_quiet_loop(self) -> None:
        """Due while the loop is busy: nothing; the first quiet look collects, once."""
        loop = _Loop()
        collector = _collector(loop)
        loop.counts[2] = 60  # due (50) but not overdue (200)
        loop.run(5.0, busy=0.9, collector=collector)
        assert loop.collections == []
        loop.run(1.0, busy=0.01, collector=collector)
        assert len(loop.full()) == 1
        assert (collector.quiet_runs, collector.forced_runs) == (1, 0)
        loop.run(5.0, busy=0.0, collector=collector)  # nothing due any more
        assert loop.collections == [(2, loop.full()[0])]

    def test_not_due_is_never_collected_in_full(self) -> None:
        """Quiet but fewer middle collections than due_after: no full collection."""
        loop = _Loop()
        collector = _collector(loop)
        loop.counts[2] = 49
        loop.run(5.0, busy=0.0, collector=collector)
        assert loop.full() == []

    def test_a_timer_due_soon_keeps_it_waiting(self) -> None:
        """A quiet loop with a timer due within the lead waits until the timer is further."""
        loop = _Loop()
        collector = _collector(loop)
        loop.counts[2], loop.due_in = 60, LEAD_S / 2
        loop.run(2.0, busy=0.0, collector=collector)
        assert loop.collections == []
        loop.due_in = 1.0
        loop.run(0.5, busy=0.0, collector=collector)
        assert len(loop.full()) == 1

    def test_a_busy_workflow_is_no_quiet_moment(self) -> None:
        """An idle share since the last look, but a workflow busy now: nothing runs."""
        loop = _Loop()
        collector = _collector(loop)
        loop.counts[2], busy = 60, [1]
        collector.in_flight = lambda: busy[0]
        loop.run(2.0, busy=0.0, collector=collector)
        assert loop.collections == []
        busy[0] = 0
        loop.run(0.25, busy=0.0, collector=collector)
        assert len(loop.full()) == 1

    def test_overdue_runs_even_when_busy(self) -> None:
        """FORCE_FACTOR times due: a busy loop gets its full collection anyway (bounded memory)."""
        loop = _Loop()
        collector = _collector(loop)
        loop.counts[2] = 50 * FORCE_FACTOR
        loop.now += LOOK_S
        loop.cpu += LOOK_S  # busy all the time since the last look
        ran = collector.look()
        assert ran is not None and ran.generation == 2 and ran.forced and ran.collected == 7
        assert collector.forced_runs == 1

    def test_a_quiet_moment_empties_the_young_generations(self) -> None:
        """Survivors of young collections (or enough new objects) are collected when quiet."""
        loop = _Loop()
        collector = _collector(loop)
        loop.counts[:] = [10, 1, 0]  # one young collection since the last middle one
        loop.run(2.0, busy=0.5, collector=collector)
        assert loop.collections == []
        loop.run(0.25, busy=0.0, collector=collector)
        assert [g for g, _ in loop.collections] == [1]
        loop.counts[0] = 999  # not worth it yet
        loop.run(2.0, busy=0.0, collector=collector)
        assert len(loop.collections) == 1
        loop.counts[0] = 1000
        loop.run(0.25, busy=0.0, collector=collector)
        assert [g for g, _ in loop.collections] == [1, 1] and collector.young_runs == 2

    def test_real_garbage_promoted_to_the_old_generation_is_freed(self) -> None:
        """With CPython's full collections out of reach, the collector frees old cyclic garbage."""
        before = gc.get_threshold()
        gc.collect()
        gc.set_threshold(700, 1, NEVER)
        collector = QuietCollector(due_after=2, young_after=10**9)
        try:
            alive: list[list[object]] = []
            for i in range(20_000):
                cycle: list[object] = [[] for _ in range(5)]
                cycle.append(cycle)
                alive.append(cycle)
                if len(alive) > 500:  # each lives long enough to reach the old generation
                    alive.pop(0)
                if i % 1000 == 0:
                    collector.look()
            gc.collect(1)
            old = len(gc.get_objects(generation=2))
            ran = None
            while ran is None:
                collector._looked = collector._now() - 1  # quiet since a second ago
                ran = collector.look() if gc.get_count()[2] >= 2 else None
                assert ran is None or ran.generation == 2
                gc.collect(1)
            assert ran.collected > 10_000  # the cycles that had reached the old generation
            assert len(gc.get_objects(generation=2)) < old - 10_000
        finally:
            gc.set_threshold(*before)
