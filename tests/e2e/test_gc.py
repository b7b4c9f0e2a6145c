"""Garbage collection in a real `workflowd`: its thresholds, the freeze, and its figures."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

from tests.helpers.harness import Daemon, running_daemon
from tests.helpers.wait import eventually, logged, settled, wait_status

MODULES = ["tests.workflows.e2e"]
TIMERS = ["tests.workflows.timers"]


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


def _stats(d: Daemon) -> dict[str, Any]:
    stats = [r for r in d.records() if r.get("event") == "gc_stats"]
    assert len(stats) == 1, d.output()
    return stats[0]


class TestNoCycles:
    async def test_fired_timers_and_their_steps_leave_no_cyclic_garbage(
        self, short_tmp: Path
    ) -> None:
        """300 timers fire, each followed by a sync step: the collector finds (almost) nothing.

        Each resume freed by reference counts alone: before, a chain's sync call and its closure
        made a cycle holding the whole resume (~60 objects per fire) for the cyclic GC.
        """
        n = 300
        # The stop's full collection counts whatever garbage is left (`collected`).
        env = {"WORKFLOWD_GC_THRESHOLD": "1000,2,50"}
        async with running_daemon(short_tmp, TIMERS, env=env) as d, d.client() as c:
            due = time.time() + 2.0
            for i in range(n):
                await c.call("start", workflow="Dozer", workflow_id=f"d{i:03d}", input={"at": due})
            for i in range(n):
                await wait_status(c, f"d{i:03d}", "Finished", limit_s=60)
            await settled(c)
            assert await d.stop() == 0
        stats = _stats(d)
        # A connection's transport is a cycle of its own (asyncio's): a few objects, not n.
        assert sum(stats["collected"]) < n, stats


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


class TestQuietFullCollections:
    async def test_full_collections_wait_for_quiet_and_free_old_garbage(
        self, short_tmp: Path
    ) -> None:
        """A full collection due during a burst of fires runs once the daemon is quiet."""
        # A full collection due after 3 middle ones: due many times over during the burst.
        env = {"WORKFLOWD_GC_THRESHOLD": "1000,1,3"}
        async with running_daemon(short_tmp, TIMERS, env=env) as d, d.client() as c:
            due = time.time() + 2.0
            n = 300
            for i in range(n):
                await c.call("start", workflow="Dozer", workflow_id=f"q{i:03d}", input={"at": due})
            for i in range(n):
                await wait_status(c, f"q{i:03d}", "Finished", limit_s=60)
            await settled(c)
            fired = [(await c.call("show", workflow_id=f"q{i:03d}"))["data"] for i in range(n)]
            burst = (min(f["fired_at"] for f in fired), max(f["woke_at"] for f in fired))
            quiet = await logged(d, "gc_full", forced=False, limit_s=30)
            assert await d.stop() == 0
        runs = [r for r in d.records() if r.get("event") == "gc_full"]
        assert quiet and all(r["busy"] < 0.05 for r in quiet), runs
        # None of the quiet ones ran while the timers fired.
        assert not [r for r in quiet if burst[0] < r["at"] < burst[1]], (burst, runs)
        assert _stats(d)["collections"][2] >= len(runs) >= 1

    async def test_100k_fires_with_old_garbage_keep_memory_bounded(self, short_tmp: Path) -> None:
        """100,000 fires each leaving ~3 KB of old cyclic garbage: RSS stays bounded.

        The daemon is busy throughout, so the full collections that free that garbage are the
        overdue ones, run anyway: without them it would grow by ~300 MB.
        """
        workflows, beats = 100, 1000
        env = {"WORKFLOWD_GC_THRESHOLD": "1000,2,5"}
        async with running_daemon(short_tmp, TIMERS, env=env) as d, d.client() as c:
            assert d.proc is not None
            for i in range(workflows):
                input = {"beats": beats, "every_s": 0.001}
                await c.call("start", workflow="Litterbug", workflow_id=f"l{i:03d}", input=input)

            async def past(beat: int) -> bool:
                return bool((await c.call("show", workflow_id="l000"))["data"]["ticked"] >= beat)

            # The workflows tick at about the same pace: ~20,000 fires by then.
            await eventually(partial(past, beats // 5), limit_s=300)
            early_mb = _rss_mb(d.proc.pid)
            for i in range(workflows):
                await wait_status(c, f"l{i:03d}", "Finished", limit_s=600)
            late_mb = _rss_mb(d.proc.pid)
            assert await d.stop() == 0
        runs = [r for r in d.records() if r.get("event") == "gc_full"]
        assert late_mb - early_mb < 60, (
            early_mb,
            late_mb,
            _stats(d),
            runs[:3],
            runs[-3:],
            len(runs),
        )
        stats = _stats(d)
        runs = [r for r in d.records() if r.get("event") == "gc_full"]
        assert any(r["forced"] for r in runs), runs
        assert stats["collected"][2] > 100_000, stats  # the old cycles, freed by full ones
