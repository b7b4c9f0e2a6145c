"""Smoke tests: every daemon benchmark runs at a tiny size and returns well-formed figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks import (
    bench_control,
    bench_dbos,
    bench_fanout,
    bench_floor,
    bench_log,
    bench_metrics,
    bench_postgres,
    bench_runtime,
    bench_schedules,
    bench_timers,
    bench_torture,
)
from tests.benchmarks.run import BENCHMARKS, normalize
from tests.helpers.disk_torture import FullPlan, disk_full_torture
from tests.helpers.postgres import Cluster


def _check(entry: str, figures: list[dict[str, Any]], metrics: set[str]) -> None:
    rows = normalize(entry, figures)
    assert {r["metric"] for r in rows} == metrics
    for row in rows:
        assert isinstance(row["value"], int | float) and row["value"] >= 0, row


class TestRegistry:
    """The runner knows the daemon benchmarks."""

    def test_registered(self) -> None:
        """Each daemon benchmark, and the floor they are read against, has a registry entry."""
        benches = {"bench_runtime", "bench_control", "bench_timers", "bench_schedules"}
        assert {*benches, "bench_floor"} <= set(BENCHMARKS)


class TestRuntimeBench:
    """bench_runtime at a tiny size."""

    async def test_in_process_and_daemon(self, tmp_path: Path) -> None:
        """Both modes report sync and async steps/s for both shapes."""
        shapes = {"one_workflow": (1, 5, 1.0), "many_workflows": (3, 2, 1.0)}
        figures = await bench_runtime.run(tmp_path, shapes=shapes, repeats=1, cache_loggers=False)
        _check(
            "bench_runtime",
            figures,
            {
                f"{s}_{k}{f}_{m}"
                for s in shapes
                for k in ("sync", "async")
                for f in ("", "_full")
                for m in ("steps_per_s", "cpu_per_step_us")
            },
        )
        assert {f["mode"] for f in figures} == {"in_process", "workflowd"}


class TestControlBench:
    """bench_control at a tiny size."""

    async def test_round_trips(self, tmp_path: Path) -> None:
        """Round-trip percentiles and callbacks/s come out for each client count."""
        figures = await bench_control.run(tmp_path, rounds={1: 5, 2: 3}, warmup=2)
        metrics = {
            f"{m}_{c}_clients_{u}"
            for c in (1, 2)
            for m, u in (
                ("send_p50", "ms"),
                ("send_p99", "ms"),
                ("callbacks", "per_s"),
                ("daemon_cpu_per_callback", "us"),
                ("client_cpu_per_callback", "us"),
            )
        } | {f"{m}_per_callback_{c}_clients" for c in (1, 2) for m in ("writes", "commits")}
        metrics |= {
            f"{t}_cpu_per_callback_{c}_clients_us" for c in (1, 2) for t in bench_control.THREADS
        }
        _check("bench_control", figures, metrics)

    async def test_control_layer(self, tmp_path: Path) -> None:
        """The control socket alone reports its loop CPU and calls per send."""
        figures = await bench_control.control_layer(tmp_path, clients=2, sends=5)
        metrics = {"control_layer_loop_cpu_per_send_us", "control_layer_loop_calls_per_send"}
        _check("bench_control", figures, metrics)


class TestTimersBench:
    """bench_timers at a tiny size."""

    async def test_lateness(self, tmp_path: Path) -> None:
        """Every timer fires and its lateness is reported."""
        figures = await bench_timers.lateness(tmp_path, n=5, window_s=0.2, min_lead_s=0.5)
        metrics = {f"timer_late_p{p}_ms" for p in (50, 99, 100)}
        fired = {"daemon_cpu_per_fired_timer_us", "loop_cpu_per_fired_timer_us"}
        gc = {
            "gc_longest_pause_ms",
            "gc_longest_pause_cpu_ms",
            "gc_slow_pauses_during_fires",
            "gc_longest_pause_during_fires_ms",
            "gc_garbage_per_fired_timer",
            "gc_full_during_fires",
        }
        # One CPU figure per thread name: which threads exist (a worker or not) may vary.
        threads = [f for f in figures if f["metric"].startswith("thread_")]
        assert {"thread_writer_cpu_per_fired_timer_us", "thread_log_cpu_per_fired_timer_us"} <= {
            f["metric"] for f in threads
        }
        rest = [f for f in figures if f not in threads]
        _check("bench_timers", rest, {*metrics, *fired, *gc})

    async def test_burst_loop(self, tmp_path: Path) -> None:
        """Rounds of bursts on one daemon: its RSS after the first, the last, and the growth."""
        figures = await bench_timers.burst_loop(tmp_path, rounds=2, n=5, window_s=0.2)
        _check(
            "bench_timers",
            figures,
            {"burst_loop_rss_first_mb", "burst_loop_rss_last_mb",
             "burst_loop_rss_growth_second_half_mb"},
        )  # fmt: skip

    async def test_own_fire(self) -> None:
        """The timer's own firing work is measured on `Arms` alone."""
        figures = await bench_timers.own_fire(n=50)
        _check(
            "bench_timers", figures, {"own_fire_cpu_per_timer_us", "own_fire_flat_cpu_per_timer_us"}
        )

    async def test_memory_and_recovery(self, tmp_path: Path) -> None:
        """Memory and recovery time of waiting workflows are reported after a restart."""
        figures = await bench_timers.memory(tmp_path, n=20)
        _check(
            "bench_timers",
            figures,
            {"idle_rss_mb", "waiting_rss_mb", "recovered_rss_mb", "starts_per_s",
             "empty_start_to_ping_s", "recovery_to_ping_s"},
        )  # fmt: skip


class TestTortureBench:
    """bench_torture's disk-full phase at a tiny size (the kill torture runs in tests/e2e)."""

    async def test_disk_full_figures(self, tmp_path: Path) -> None:
        """The disk fills once; the zero-target figures come out, and they are zero."""
        report = await disk_full_torture(tmp_path, FullPlan(collectors=2, fills=1))
        if report.skipped:
            pytest.skip(report.skipped)
        figures = bench_torture.full_figures(report, seed=1)
        metrics = {f"disk_full_{m}" for m in (
            "fills", "acked_sends", "acked_no_wait_sends", "refused_sends",
            "checkpoint_failures", "acked_lost", "acked_out_of_order", "acked_stranded",
            "refused_but_applied", "daemon_exits", "problems", "duration_s",
        )}  # fmt: skip
        _check("bench_torture", figures, metrics)
        assert all(f["value"] == 0 for f in figures if f["target"] == 0), figures


class TestSchedulesBench:
    """bench_schedules at a tiny size."""

    async def test_lateness(self, tmp_path: Path) -> None:
        """Every fire due in the window happens; its lateness and the CPU per fire are reported."""
        figures = await bench_schedules.measure(tmp_path, schedules=5, window_s=2.0)
        metrics = {f"{k}_p{p}_ms" for k in ("fire_late", "start_late") for p in (50, 99)}
        _check("bench_schedules", figures, {*metrics, "daemon_cpu_per_fire_us"})
        assert {f["fires"] for f in figures} == {10}


class TestLogBench:
    """bench_log at a tiny size."""

    async def test_figures(self) -> None:
        """It prints the loop cost of each kind of record."""
        figures = await bench_log.run(records=300)
        _check(
            "bench_log",
            figures,
            {"info_record_loop_us", "filtered_debug_record_loop_us", "error_record_us"}
            | {"info_record_cpu_us", "step_done_call_loop_us"}
            | {"info_record_writer_us"},
        )


class TestMetricsBench:
    """bench_metrics at a tiny size."""

    def test_step_collection(self) -> None:
        """The per-step collection cost and one scrape's time are reported."""
        figures = bench_metrics.run(calls=1000, repeats=1)
        _check("bench_metrics", figures, {"step_collect_us", "scrape_ms"})


class TestFanoutBench:
    """bench_fanout at a tiny size."""

    async def test_fan_out_and_separate(self, tmp_path: Path) -> None:
        """Both shapes report steps/s and wall time, and the slowdown between them."""
        figures = await bench_fanout.run(
            tmp_path, threads=3, steps=2, repeats=1, cache_loggers=False
        )
        metrics = {
            f"{s}_{m}"
            for s in ("fan_out", "separate")
            for m in ("steps_per_s", "wall_ms", "cpu_per_step_us")
        }
        _check("bench_fanout", figures, {*metrics, "slowdown"})


class TestPostgresBench:
    """bench_postgres at a tiny size."""

    async def test_group_sizes_and_takeover(self, tmp_path: Path, pg_cluster: Cluster) -> None:
        """Steps/s for one and two daemons, and a takeover time, as figures."""
        figures = await bench_postgres.run(
            tmp_path, workflows=3, steps=2, nodes=(1, 2), lease_s=2.0, cluster=pg_cluster
        )
        _check(
            "bench_postgres",
            figures,
            {
                "daemons_1_steps_per_s",
                "daemons_2_steps_per_s",
                "daemons_1_cpu_ms_per_step",
                "daemons_2_cpu_ms_per_step",
                "takeover_after_sigkill_s",
            },
        )


class TestDbosBench:
    """bench_dbos at a tiny size: DBOS side by side, or null figures with a note."""

    SHAPES = {"many_workflows": (3, 2), "one_workflow": (1, 5)}  # noqa: RUF012

    def _metrics(self) -> set[str]:
        ours = {
            f"workflowd_{s}_{sync}_{m}"
            for s in self.SHAPES
            for sync in ("full", "normal")
            for m in ("steps_per_s", "cpu_per_step_us")
        }
        return ours | {f"ratio_{s}_{sync}" for s in self.SHAPES for sync in ("full", "normal")}

    async def test_without_dbos(self, tmp_path: Path) -> None:
        """No DBOS to run: its figures and the ratios are null with a note; ours still come out."""
        figures = await bench_dbos.run(
            tmp_path, shapes=self.SHAPES, repeats=1, venv=tmp_path / "none", install=False
        )
        rows = normalize("bench_dbos", figures)
        dbos = {f"dbos_{s}_steps_per_s" for s in self.SHAPES}
        assert {r["metric"] for r in rows} == self._metrics() | dbos
        for row in rows:
            if row["metric"] in dbos or row["metric"].startswith("ratio_"):
                assert row["value"] is None and "not installed" in row["note"], row
            else:
                assert isinstance(row["value"], int | float) and row["value"] >= 0, row
        targets = {r["metric"]: r["target"] for r in rows if r["metric"].startswith("ratio_")}
        assert targets["ratio_many_workflows_full"] == 60.0
        assert targets["ratio_one_workflow_full"] == 9.0

    async def test_with_cached_dbos(self, tmp_path: Path) -> None:
        """With DBOS's virtualenv already cached, every figure is a number, ratios included."""
        venv = bench_dbos.cache_dir() / "dbos-3.4"
        if not (venv / "bin" / "python").exists():
            pytest.skip(f"no cached DBOS virtualenv in {venv} (run the benchmark once)")
        figures = await bench_dbos.run(
            tmp_path, shapes=self.SHAPES, repeats=1, venv=venv, install=False
        )
        dbos = {f"dbos_{s}_{m}" for s in self.SHAPES for m in ("steps_per_s", "cpu_per_step_us")}
        _check("bench_dbos", figures, self._metrics() | dbos)


class TestFloorBench:
    """bench_floor at a tiny size."""

    async def test_figures(self, tmp_path: Path) -> None:
        """It reports the bare and the pool's hand-off, and the bare server's round trips."""
        figures = await bench_floor.run(tmp_path, handoffs=20, rounds={1: 5, 2: 3})
        socket = {
            f"socket_bare_server_{k}_{c}_clients_{u}"
            for c in (1, 2)
            for k, u in (("cpu_per_round_trip", "us"), ("ceiling", "per_s"))
        }
        handoffs = {"handoff_bare_loop_cpu_us", "handoff_workers_loop_cpu_us"}
        _check("bench_floor", figures, handoffs | socket)
