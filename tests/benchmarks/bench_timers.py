"""Timer benchmark: lateness under a burst of deadlines, and memory/recovery of many waiters.

Both parts run a real workflowd and start their `Alarm` workflows through the control socket
(pipelined over 16 connections). Lateness is measured by the workflow itself: the step right
after the timer's Wait stores `time.time() - deadline`, so it covers firing the timer, the
durable callback and the resume that runs that step.

What a fired timer costs (`*_cpu_per_fired_timer_us`) is the CPU the daemon spends from the
moment every workflow waits on its timer until every one has finished, divided by the timers:
the timer's own firing (the heap, the hand-over to the workflow's actor, starting its task),
the callback, the workflow's resume after it (its `measure` step, a sync step run on a worker
thread, and its end), the commit of all that (one per fire, written by the store's writer
thread), the log lines and the garbage collection all that causes. `daemon_` counts every
thread of the process; `loop_` only the event loop's thread (the process's main thread, read
from schedstat in nanoseconds), which is the one that bounds how many fires a second the
daemon keeps up with (the writer, the workers and the log batcher run beside it). Both
include whatever else the daemon does meanwhile, spread over the fires. At the moderate load
(a tenth of the burst) a fire costs several times more: a profile shows the worker, writer
and log threads woken once per fire there, where a burst wakes them once per batch. `rearm` measures a fire with no step after it: the callback and
the re-arm of the next timer, one commit. `own_fire` is the timer's own part alone, in
process (`own_fire_flat`: the same on the system clock, the daemon's path). The machine is shared: compare figures taken back to back, CPU rather than time.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from daemon.clock import FakeClock, SystemClock
from daemon.core.handler import CallbackRequest
from daemon.runtime.arming import Arms
from tests.helpers.client import connect
from tests.helpers.harness import Daemon

from .bench_workflows import Alarm, Ticking
from .common import bench_daemon, call_many, cpu_s, percentile, query, rss_mb, until_count

LATENESS_TIMERS = 10_000
WINDOW_S = 5.0
#: A conservative guess of starts/s, to put the window after every workflow has started.
STARTS_PER_S_GUESS = 1_000.0
MEMORY_WORKFLOWS = 100_000
#: The size of the seeded-database figure; 0 (the default) skips it. Run it with
#: `WORKFLOWD_BENCH_SLEEPERS=1000000 python -m tests.benchmarks.run timers`.
SLEEPERS = int(os.environ.get("WORKFLOWD_BENCH_SLEEPERS", "0"))
TARGET_SLEEPERS_RSS_MB = 1024.0
TARGET_SLEEPERS_READY_S = 10.0
TARGET_RSS_MB = 500.0
#: The event loop's CPU per fired timer (issue 16: "fired timer, loop CPU <= 100 us").
TARGET_FIRE_US = 100.0
#: Issue 16: "10,000 timers due within 5 s, lateness p99 <= 3 ms".
TARGET_LATE_P99_MS = 3.0
CONNECTIONS = 16
_UNITS = (("_ms", "ms"), ("_us", "us"), ("_mb", "MB"), ("_per_s", "1/s"), ("_s", "s"))
_COUNT = "SELECT COUNT(*) FROM workflows WHERE status = ?"


def loop_cpu_s(pid: int) -> float:
    """Return the CPU seconds the process's main thread (workflowd's event loop) has used."""
    # schedstat counts in nanoseconds; stat's clock ticks are too coarse for a thread that
    # runs in short bursts.
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


def _starts(n: int, at: float, spread_s: float) -> list[dict[str, Any]]:
    return [
        {"op": "start", "workflow": Alarm.name, "workflow_id": f"a{i:07d}",
         "input": {"at": at + spread_s * i / n}}
        for i in range(n)
    ]  # fmt: skip


def _figure(metric: str, value: float, target: float | None, **context: Any) -> dict[str, Any]:
    unit = next((u for suffix, u in _UNITS if metric.endswith(suffix)), "")
    return {"bench": "timers", "metric": metric, "value": value, "unit": unit, "target": target,
            "mode": "workflowd", **context}  # fmt: skip


async def lateness(
    tmp: Path,
    n: int = LATENESS_TIMERS,
    window_s: float = WINDOW_S,
    min_lead_s: float = 2.0,
    label: str = "",
) -> list[dict[str, Any]]:
    """Start `n` workflows whose timers fall due within the same `window_s`; return lateness."""
    async with bench_daemon(tmp) as d:
        assert d.proc is not None
        db = d.tmp / "wd.db"
        window_at = time.time() + max(min_lead_s, n / STARTS_PER_S_GUESS)
        await call_many(d.socket, _starts(n, window_at, window_s), CONNECTIONS)
        # A start is answered once its row is durable; its first resume (the timer's setup)
        # may still run. The CPU counted from here on is the fires' alone.
        # (A workflow goes from Waiting to Finished in one commit, its fire.)
        settled = "SELECT COUNT(*) FROM workflows WHERE status != ?"
        await until_count(db, settled, ("Resuming",), n, limit_s=300, every_s=0.05)
        lead_s = window_at - time.time()
        cpu, loop = cpu_s(d.proc.pid), loop_cpu_s(d.proc.pid)
        threads = thread_cpu_s(d.proc.pid)
        fires_from = time.time()
        limit_s = lead_s + window_s + 300
        await until_count(db, _COUNT, ("Finished",), n, limit_s=limit_s, every_s=0.1)
        cpu, loop = cpu_s(d.proc.pid) - cpu, loop_cpu_s(d.proc.pid) - loop
        threads = {k: v - threads.get(k, 0.0) for k, v in thread_cpu_s(d.proc.pid).items()}
        fires_to = time.time()
        rows = query(db, "SELECT data FROM workflows")
    late = [json.loads(data)["late_s"] * 1000 for (data,) in rows]
    gc_figures = _gc_figures(d.records(), fires_from, fires_to, label, n)
    context = {
        "timers": n,
        "window_s": window_s,
        "all_started_before_window_by_s": round(lead_s, 2),
    }
    return [
        *(
            _figure(
                f"timer_late{label}_p{p}_ms",
                round(percentile(late, p), 2),
                TARGET_LATE_P99_MS if p == 99 and not label else None,
                **context,
            )
            for p in (50, 99, 100)
        ),
        _figure(f"daemon_cpu_per_fired_timer{label}_us", round(cpu / n * 1e6), None, **context),
        _figure(
            f"loop_cpu_per_fired_timer{label}_us", round(loop / n * 1e6), TARGET_FIRE_US, **context
        ),
        *(
            _figure(f"{name}_cpu_per_fired_timer{label}_us", round(s / n * 1e6), None, **context)
            for name, s in sorted(threads.items())
        ),
        *(_figure(metric, value, None, **context | extra) for metric, value, extra in gc_figures),
    ]


def thread_cpu_s(pid: int) -> dict[str, float]:
    """Return the CPU seconds of the process's threads, summed by thread name (schedstat)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        key = ("thread_" + name.removeprefix("wd-")).replace("-", "_")
        out[key] = out.get(key, 0.0) + ns / 1e9
    return out


def _gc_figures(
    records: list[dict[str, Any]], since: float, until: float, label: str, timers: int = 1
) -> list[tuple[str, float, dict[str, Any]]]:
    """Return the GC figures the daemon logged: its life's totals, and slow pauses during fires."""
    stats = next((r for r in records if r.get("event") == "gc_stats"), None)
    if stats is None:
        return []
    extra: list[tuple[str, float, dict[str, Any]]] = []
    if "collected" in stats:  # a daemon that counts its garbage (and runs full ones when quiet)
        full = [r for r in records if r.get("event") == "gc_full"]
        during = [r for r in full if since <= r["at"] <= until]
        extra = [
            (f"gc_garbage_per_fired_timer{label}", round(sum(stats["collected"]) / timers, 2), {
                "how": "objects the cyclic GC freed over the daemon's life (its stop's untimed full"
                       " collection included), per timer: reference cycles left behind",
                "collected": stats["collected"],
            }),
            (f"gc_full_during_fires{label}", len(during), {
                "forced": sum(r["forced"] for r in during), "over_life": len(full),
                "how": "full collections (gc_full) while the timers fired",
            }),
        ]  # fmt: skip
    pauses = [r for r in records if r.get("event") == "gc_pause" and since <= r["at"] <= until]
    slow = [r["ms"] for r in pauses]
    by_generation = [sum(r["generation"] == g for r in pauses) for g in range(3)]
    life = {"over": "the daemon's life: starts and fires", "threshold": stats["threshold"]}
    return [
        (f"gc_longest_pause{label}_ms", max(stats["longest_ms"]), life | {
            "by_generation_ms": stats["longest_ms"],
            "collections": stats["collections"],
            "total_ms": stats["total_ms"],
        }),
        (f"gc_longest_pause_cpu{label}_ms", max(stats["cpu_longest_ms"]), life | {
            "by_generation_ms": stats["cpu_longest_ms"],
            "collections": stats["collections"],
            "total_ms": stats["cpu_total_ms"],
            "how": "the collector's CPU time, without waiting for a core",
        }),
        (f"gc_slow_pauses_during_fires{label}", len(slow),
         {"slower_than_ms": 10.0, "by_generation": by_generation}),
        (f"gc_longest_pause_during_fires{label}_ms", round(max(slow, default=0.0), 2),
         {"how": "0: none slower than 10 ms"}),
        *extra,
    ]  # fmt: skip


BURST_ROUNDS = 10
BURST_TIMERS = 2_000


async def burst_loop(
    tmp: Path, rounds: int = BURST_ROUNDS, n: int = BURST_TIMERS, window_s: float = 1.0
) -> list[dict[str, Any]]:
    """Run `rounds` bursts of `n` timers on one daemon; return its RSS after each (bounded?).

    Each round starts `n` Alarm workflows due within `window_s` and waits until they finished,
    so the daemon's memory is read after the same work, round after round: a leak (cyclic
    garbage that no collection frees, objects kept past their workflow) grows it every round.
    """
    rss: list[float] = []
    async with bench_daemon(tmp) as d:
        assert d.proc is not None
        db = d.tmp / "wd.db"
        for r in range(rounds):
            at = time.time() + max(1.0, n / STARTS_PER_S_GUESS)
            starts = [{**s, "workflow_id": f"r{r:03d}{s['workflow_id']}"}
                      for s in _starts(n, at, window_s)]  # fmt: skip
            await call_many(d.socket, starts, CONNECTIONS)
            await until_count(db, _COUNT, ("Finished",), n * (r + 1), limit_s=300, every_s=0.05)
            rss.append(rss_mb(d.proc.pid))
    full = [r for r in d.records() if r.get("event") == "gc_full"]
    ctx = {"rounds": rounds, "timers": n, "window_s": window_s, "rss_mb": [round(m, 1) for m in rss],
           "gc_full": len(full), "gc_full_forced": sum(r["forced"] for r in full)}  # fmt: skip
    half = rss[len(rss) // 2]
    return [
        _figure("burst_loop_rss_first_mb", round(rss[0], 1), None, **ctx),
        _figure("burst_loop_rss_last_mb", round(rss[-1], 1), None, **ctx),
        _figure(
            "burst_loop_rss_growth_second_half_mb",
            round(max(rss[-1] - half, 0.0), 1),
            None,
            how="RSS after the last round minus after the middle one (0 if it shrank; each"
            " round's in rss_mb): ~0 when bounded",
            **ctx,
        ),
    ]


REARM_WORKFLOWS = 1_000
REARM_BEATS = 10


async def rearm(
    tmp: Path, n: int = REARM_WORKFLOWS, beats: int = REARM_BEATS
) -> list[dict[str, Any]]:
    """Run `n` workflows that each fire `beats` timers in a row (no step); return CPU per fire.

    Each fire is a timer's callback and the re-arm of the next one, so this is what firing a
    timer costs, apart from the steps a workflow runs after it.
    """
    async with bench_daemon(tmp) as d:
        assert d.proc is not None
        db = d.tmp / "wd.db"
        starts = [
            {"op": "start", "workflow": Ticking.name, "workflow_id": f"t{i:06d}",
             "input": {"beats": beats, "every_s": 0.2}}
            for i in range(n)
        ]  # fmt: skip
        await call_many(d.socket, starts, CONNECTIONS)
        # Every first timer is armed (its start settled): the CPU from here on is all fires.
        # (Once past its first fire a workflow may show Resuming, so this counts those too.)
        armed = "SELECT COUNT(*) FROM workflows WHERE status = ? OR data ->> 'ticked' > 0"
        await until_count(db, armed, ("Waiting",), n, limit_s=120, every_s=0.05)
        cpu, loop = cpu_s(d.proc.pid), loop_cpu_s(d.proc.pid)
        await until_count(db, _COUNT, ("Finished",), n, limit_s=300, every_s=0.05)
        cpu, loop = cpu_s(d.proc.pid) - cpu, loop_cpu_s(d.proc.pid) - loop
    fires = n * beats
    ctx = {"workflows": n, "beats": beats, "how": "timer re-armed by its own callback, no step"}
    return [
        _figure("daemon_cpu_per_rearmed_timer_us", round(cpu / fires * 1e6), None, **ctx),
        _figure("loop_cpu_per_rearmed_timer_us", round(loop / fires * 1e6), TARGET_FIRE_US, **ctx),
    ]


OWN_FIRES = 100_000


async def own_fire(n: int = OWN_FIRES) -> list[dict[str, Any]]:
    """Fire `n` timers due at once through `Arms` alone (in process); return CPU per timer.

    This is the timer's own firing work: popping it off the heap and handing its callback
    over (to a no-op here; the daemon's queues it for the workflow's actor). The rest of a
    fire is the actor's: the callback, the resume, the commit.
    """
    clock, fired = FakeClock(), [0]

    def fire(req: CallbackRequest, input: Any) -> None:
        fired[0] += 1

    async def submit(req: CallbackRequest, input: Any, wait: bool) -> None:
        raise AssertionError("no listener here")

    async with anyio.create_task_group() as tg:
        arms = Arms(tg, clock, submit, lambda req, error: None, fire=fire)
        now = clock.now()
        arms.arm_timers(((f"w{i:07d}", "_main_", "t", 1), now + 1 + i / n) for i in range(n))
        tg.start_soon(arms.run_timers)
        await anyio.lowlevel.checkpoint()
        start = time.thread_time()
        clock.advance(10)
        while fired[0] < n:
            await anyio.lowlevel.checkpoint()
        cpu = time.thread_time() - start
        tg.cancel_scope.cancel()
    ctx = {"timers": n, "how": "Arms alone, in process: heap pop and hand-over"}
    return [
        _figure("own_fire_cpu_per_timer_us", round(cpu / n * 1e6, 2), None, **ctx),
        *await _own_fire_flat(n),
    ]


async def _own_fire_flat(n: int) -> list[dict[str, Any]]:
    """The same on the system clock, as a daemon fires: one loop callback per batch."""
    fired = [0]

    def fire(req: CallbackRequest, input: Any) -> None:
        fired[0] += 1

    async def submit(req: CallbackRequest, input: Any, wait: bool) -> None:
        raise AssertionError("no listener here")

    async with anyio.create_task_group() as tg:
        arms = Arms(tg, SystemClock(), submit, lambda req, error: None, fire=fire)
        now = time.time()
        # Due a moment from now, all of them: armed first, then fired in one burst.
        arms.arm_timers(
            ((f"w{i:07d}", "_main_", "t", 1), now + 0.5 + i / n * 1e-4) for i in range(n)
        )
        tg.start_soon(arms.run_timers)
        await anyio.sleep(max(0.0, now + 0.5 - time.time()))
        start = time.thread_time()
        while fired[0] < n:
            await anyio.lowlevel.checkpoint()
        cpu = time.thread_time() - start
        tg.cancel_scope.cancel()
    ctx = {"timers": n, "how": "Arms alone, in process, system clock: the daemon's path"}
    return [_figure("own_fire_flat_cpu_per_timer_us", round(cpu / n * 1e6, 2), None, **ctx)]


async def _start_bounded(d: Daemon, limit_s: float) -> float:
    """Spawn the daemon and return the seconds until it answers ping."""
    start = time.perf_counter()
    proc = d.spawn()
    with anyio.fail_after(limit_s):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"workflowd exited {proc.returncode}:\n{d.output()[-2000:]}")
            try:
                async with connect(d.socket) as c:
                    if (await c.request("ping"))["ok"]:
                        return time.perf_counter() - start
            except OSError:
                pass
            await anyio.sleep(0.01)


async def memory(tmp: Path, n: int = MEMORY_WORKFLOWS) -> list[dict[str, Any]]:
    """Hold `n` workflows each waiting on a timer a day away; return RSS and recovery time."""
    async with bench_daemon(tmp) as d:
        assert d.proc is not None
        db = d.tmp / "wd.db"
        await d.stop()
        empty_start_s = await _start_bounded(d, 60)
        idle_mb = rss_mb(d.proc.pid)
        start = time.perf_counter()
        await call_many(d.socket, _starts(n, time.time() + 86_400, 0.0), CONNECTIONS)
        await until_count(db, _COUNT, ("Waiting",), n, limit_s=600, every_s=0.2)
        start_rate = n / (time.perf_counter() - start)
        loaded_mb = rss_mb(d.proc.pid)
        await d.stop()
        recovery_s = await _start_bounded(d, 600)
        recovered_mb = rss_mb(d.proc.pid)
        async with connect(d.socket) as c:
            counts = (await c.call("ping"))["workflows"]
        if counts != {"Waiting": n}:
            raise AssertionError(f"after recovery: {counts}")
    ctx = {"workflows": n}
    return [
        _figure("idle_rss_mb", round(idle_mb, 1), None, workflows=0),
        _figure(
            "waiting_rss_mb", round(loaded_mb, 1), TARGET_RSS_MB, how="started via socket", **ctx
        ),
        _figure(
            "recovered_rss_mb", round(recovered_mb, 1), TARGET_RSS_MB, how="after restart", **ctx
        ),
        _figure("starts_per_s", round(start_rate), None, connections=CONNECTIONS, **ctx),
        _figure("empty_start_to_ping_s", round(empty_start_s, 3), None, workflows=0),
        _figure("recovery_to_ping_s", round(recovery_s, 3), None, **ctx),
    ]


def _seed(db: Path, template_id: str, n: int) -> None:
    """Copy one waiting workflow's row `n` times (ids of the template's width) into `db`."""
    conn = sqlite3.connect(db)
    try:
        cols = "name, status, data, state, error, attempt, next_run_at, created_at, updated_at"
        name, status, data, state, *rest = conn.execute(
            f"SELECT {cols} FROM workflows WHERE id = ?", (template_id,)
        ).fetchone()
        head, width = template_id[0], len(template_id) - 1
        chunk = 50_000
        for first in range(0, n, chunk):
            rows = []
            for i in range(first, min(n, first + chunk)):
                wid = f"{head}{i:0{width}d}"
                rows.append((wid, name, status, data, state.replace(template_id, wid), *rest))
            conn.executemany(
                f"INSERT OR REPLACE INTO workflows (id, {cols}, history_seq)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                rows,
            )
            conn.commit()
    finally:
        conn.close()


async def sleepers(tmp: Path, n: int) -> list[dict[str, Any]]:
    """Seed `n` workflows waiting on a timer a week away straight into SQLite; time a start.

    The rows are copies of one workflow started through the socket, so they are what the
    daemon writes; the figures are the start (recovery included) until READY, and its RSS.
    """
    async with bench_daemon(tmp) as d:
        assert d.proc is not None
        db = d.tmp / "wd.db"
        wid = "s" + "0" * len(str(max(n - 1, 1)))
        await call_many(d.socket, [{"op": "start", "workflow": Alarm.name, "workflow_id": wid,
                                    "input": {"at": time.time() + 7 * 86_400}}])  # fmt: skip
        await until_count(db, _COUNT, ("Waiting",), 1, limit_s=30)
        await d.stop()
        start = time.perf_counter()
        await anyio.to_thread.run_sync(_seed, db, wid, n)
        seed_s = time.perf_counter() - start
        ready_s = await _start_bounded(d, 900)
        ready_mb, ready_cpu_s = rss_mb(d.proc.pid), cpu_s(d.proc.pid)
        async with connect(d.socket) as c:
            ping = await c.call("ping")
        if ping["workflows"] != {"Waiting": n}:
            raise AssertionError(f"after the start: {ping['workflows']}")
    ctx = {"workflows": n, "how": "seeded rows, then a start", "seed_s": round(seed_s, 1)}
    return [
        _figure("sleepers_ready_s", round(ready_s, 2), TARGET_SLEEPERS_READY_S, **ctx),
        # The process's CPU until READY (all threads): steadier than the time on a busy box.
        _figure("sleepers_ready_cpu_s", round(ready_cpu_s, 2), None, **ctx),
        _figure("sleepers_rss_mb", round(ready_mb, 1), TARGET_SLEEPERS_RSS_MB, **ctx),
    ]


async def run(
    tmp: Path,
    timers: int = LATENESS_TIMERS,
    workflows: int = MEMORY_WORKFLOWS,
    seeded: int = SLEEPERS,
) -> list[dict[str, Any]]:
    """Measure timer lateness, then memory and recovery time of many waiting workflows.

    With `seeded` (WORKFLOWD_BENCH_SLEEPERS) it also starts on that many seeded sleepers.
    """
    # A moderate load (a tenth of the burst) shows lateness when the daemon keeps up.
    moderate = await lateness(tmp / "moderate", max(1, timers // 10), label="_moderate")
    burst = await lateness(tmp / "lateness", timers)
    figures = [*moderate, *burst, *await rearm(tmp / "rearm"), *await own_fire()]
    figures += await burst_loop(tmp / "burst_loop")
    figures += await memory(tmp / "memory", workflows)
    if seeded:
        figures += await sleepers(tmp / "sleepers", seeded)
    return figures
