"""Garbage collection in a real `workflowd`: its thresholds, the freeze, and its figures."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.harness import running_daemon

MODULES = ["tests.workflows.e2e"]


class TestGcStats:
    async def test_stop_logs_the_collections_under_the_tuned_thresholds(
        self, tmp_path: Path
    ) -> None:
        """A clean stop logs gc_stats: the tuned thresholds, a frozen heap, pauses per generation."""
        async with running_daemon(tmp_path, MODULES) as d:
            assert await d.stop() == 0
        stats = [r for r in d.records() if r.get("event") == "gc_stats"]
        assert len(stats) == 1, d.output()
        s = stats[0]
        assert s["threshold"] == [10000, 2, 50]
        assert s["frozen"] > 0  # what recovery loaded is out of every collection's way
        for key in ("collections", "total_ms", "longest_ms", "cpu_total_ms", "cpu_longest_ms"):
            assert len(s[key]) == 3, key
        assert all(
            longest <= total for longest, total in zip(s["longest_ms"], s["total_ms"], strict=True)
        )

    async def test_environment_overrides_the_thresholds(self, tmp_path: Path) -> None:
        """WORKFLOWD_GC_THRESHOLD=a,b,c sets them; a value that does not parse is ignored."""
        for value, expected in (("5000,3,20", [5000, 3, 20]), ("lots", [10000, 2, 50])):
            folder = tmp_path / value.replace(",", "_")
            folder.mkdir()
            env = {"WORKFLOWD_GC_THRESHOLD": value}
            async with running_daemon(folder, MODULES, env=env) as d:
                assert await d.stop() == 0
            stats = [r for r in d.records() if r.get("event") == "gc_stats"]
            assert [s["threshold"] for s in stats] == [expected], d.output()
