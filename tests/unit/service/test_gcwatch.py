"""Tests for daemon.service.gcwatch: each collection timed, slow ones kept for the log."""

from __future__ import annotations

import gc

from daemon.service.gcwatch import GcWatch


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

    def test_uninstalled_counts_nothing(self) -> None:
        """Once uninstalled, collections are not timed any more."""
        watch = GcWatch()
        watch.install()
        watch.install()  # a second install does not double-count
        watch.uninstall()
        gc.collect()
        assert watch.collections == [0, 0, 0]
