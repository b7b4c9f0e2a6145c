"""Control-socket benchmark: `send` round trips and durable callbacks/s through a real workflowd.

Each client owns one `Pinged` workflow and sends it "ping" in a loop, one request at a
time on its own connection. A send is answered once its callback is committed, so every
round trip measured is one durable callback. The clients run in this process, each a thread
with a blocking socket and its request line made once: they share the two cores with the
daemon, and an anyio socket stream per client (which registers with the selector on every
receive) cost ~180 µs of CPU per round trip, as much as a third of the daemon's. Their CPU
per round trip is printed too (`client_cpu_per_callback_*`), and so are the writes and commits
per callback, from the daemon's `/metrics` (`writes_per_callback_*`: 1 when a callback and the
resume it starts are one checkpoint; `commits_per_callback_*`: below 1 when group commit
batches several clients' callbacks). The daemon's CPU per callback is split by thread
(`loop_`, `writer_`, `log_cpu_per_callback_*`, from /proc's schedstat of each thread): only
the daemon's threads count there, never this process's clients.

`control_layer` measures the control socket alone, in this process: the same clients against
`serve()` over a backend that answers each `send` at once (no actor, no commit), with the
event loop's CPU (the best of three rounds) and its Python function calls (cProfile, a round
of its own) per send.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from prometheus_client.parser import text_string_to_metric_families

from daemon.control.server import serve
from tests.helpers.harness import Daemon
from tests.helpers.http import fetch
from tests.helpers.memory import MemoryBackend

from .bench_timers import loop_cpu_s, thread_cpu_s
from .bench_workflows import Pinged
from .common import bench_daemon, call_many, cpu_s, percentile, query, until_count

#: clients -> sends per client
ROUNDS: dict[int, int] = {1: 3_000, 16: 1_000}
WARMUP = 200
#: The daemon's threads whose CPU per callback is printed (the event loop, then the names
#: `thread_cpu_s` gives).
THREADS = {"loop": "loop", "writer": "thread_writer", "log": "thread_log"}
#: Issue 16's targets: one client's round trip, and 16 clients' durable callbacks/s.
TARGET_P50_MS_ONE_CLIENT, TARGET_P99_MS_ONE_CLIENT = 0.3, 1.0
TARGET_CALLBACKS_PER_S_16 = 15_000.0


def _client(socket_path: Path, workflow_id: str, sends: int, out: list[float]) -> None:
    """Send "ping" `sends` times, one at a time, on a blocking socket; note each round trip."""
    request = {"id": 1, "op": "send", "workflow_id": workflow_id, "event": "ping", "input": 1}
    line = json.dumps(request).encode() + b"\n"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(socket_path))
        answers = sock.makefile("rb")
        clock = time.perf_counter
        for _ in range(sends):
            start = clock()
            sock.sendall(line)
            answer = answers.readline()
            out.append(clock() - start)
            if b'"ok":true' not in answer:
                raise RuntimeError(f"send failed: {answer!r}")


def _clients(socket_path: Path, tag: str, clients: int, sends: int) -> list[float]:
    """Run `clients` clients at once, each in a thread of its own; return every round trip."""
    latencies: list[float] = []
    errors: list[BaseException] = []

    def one(n: int) -> None:
        try:
            _client(socket_path, f"{tag}-{n}", sends, latencies)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return latencies


async def _written(address: str) -> tuple[float, float]:
    """Return the writes and the commits the daemon has made so far (from `/metrics`)."""
    reply = await fetch(address, "/metrics")
    found = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            if s.name in ("workflowd_commit_batch_size_sum", "workflowd_commit_batch_size_count"):
                found[s.name.rsplit("_", 1)[1]] = float(s.value)
    return found["sum"], found["count"]


async def _round(d: Daemon, tag: str, clients: int, sends: int) -> tuple[list[float], float]:
    """Return every round trip (s) and the elapsed wall time of one round."""
    start = time.perf_counter()
    latencies = await anyio.to_thread.run_sync(_clients, d.socket, tag, clients, sends)
    return latencies, time.perf_counter() - start


async def run(tmp: Path, rounds: dict[int, int] | None = None, warmup: int = WARMUP) -> list[Any]:
    """Measure send round trips with 1 and 16 clients, and durable callbacks/s."""
    rounds = rounds or ROUNDS
    figures: list[dict[str, Any]] = []
    metrics = str(tmp / "daemon" / "metrics.sock")
    async with bench_daemon(tmp / "daemon", metrics={"listen": metrics}) as d:
        assert d.proc is not None
        db = d.tmp / "wd.db"
        ids = [f"c{clients}-{n}" for clients in rounds for n in range(clients)]
        await call_many(d.socket, [{"op": "start", "workflow": Pinged.name, "workflow_id": i}
                                   for i in ids])  # fmt: skip
        waiting = "SELECT COUNT(*) FROM workflows WHERE status = 'Waiting'"
        await until_count(db, waiting, (), len(ids), limit_s=60)
        for clients, sends in rounds.items():
            tag = f"c{clients}"
            await _round(d, tag, clients, max(1, warmup // clients))
            written = await _written(metrics)
            cpu, mine = cpu_s(d.proc.pid), time.process_time()
            threads = {**thread_cpu_s(d.proc.pid), "loop": loop_cpu_s(d.proc.pid)}
            latencies, elapsed = await _round(d, tag, clients, sends)
            cpu_us = (cpu_s(d.proc.pid) - cpu) / len(latencies) * 1e6
            after = {**thread_cpu_s(d.proc.pid), "loop": loop_cpu_s(d.proc.pid)}
            threads = {k: v - threads.get(k, 0.0) for k, v in after.items()}
            writes, commits = (b - a for a, b in zip(written, await _written(metrics), strict=True))
            client_us = (time.process_time() - mine) / len(latencies) * 1e6
            context = {"mode": "workflowd", "clients": clients, "sends_each": sends}
            context["synchronous"] = "normal"  # bench_daemon's
            p50, p99 = (round(percentile(latencies, p) * 1000, 3) for p in (50, 99))
            target = TARGET_P50_MS_ONE_CLIENT if clients == 1 else None
            p99_target = TARGET_P99_MS_ONE_CLIENT if clients == 1 else None
            rate_target = TARGET_CALLBACKS_PER_S_16 if clients == 16 else None
            figures += [
                {"metric": f"send_p50_{clients}_clients_ms", "value": p50, "target": target},
                {"metric": f"send_p99_{clients}_clients_ms", "value": p99, "target": p99_target},
                {"metric": f"callbacks_{clients}_clients_per_s",
                 "value": round(len(latencies) / elapsed), "target": rate_target},
                {"metric": f"daemon_cpu_per_callback_{clients}_clients_us",
                 "value": round(cpu_us), "target": None},
                {"metric": f"client_cpu_per_callback_{clients}_clients_us",
                 "value": round(client_us), "target": None},
                {"metric": f"writes_per_callback_{clients}_clients",
                 "value": round(writes / len(latencies), 2), "target": None},
                {"metric": f"commits_per_callback_{clients}_clients",
                 "value": round(commits / len(latencies), 2), "target": None},
                *({"metric": f"{name}_cpu_per_callback_{clients}_clients_us",
                   "value": round(threads.get(key, 0.0) / len(latencies) * 1e6), "target": None}
                  for name, key in THREADS.items()),
            ]  # fmt: skip
            for fig in figures[-7 - len(THREADS) :]:
                unit = fig["metric"].rsplit("_", 1)[1]
                unit = "1/s" if "per_s" in fig["metric"] else "" if unit == "clients" else unit
                fig.update(bench="control", unit=unit)
                fig.update(context)
            expected = max(1, warmup // clients) + sends
            rows = query(db, "SELECT data FROM workflows WHERE id LIKE ?", (f"{tag}-%",))
            counts = {json.loads(data)["count"] for (data,) in rows}
            if counts != {expected}:
                raise AssertionError(f"stored counts {counts}, expected {expected} each")
    return figures


#: Rounds of `control_layer` whose CPU is measured; the least per send is printed.
CONTROL_LAYER_ROUNDS = 3


class _Answered:
    """An answer that is in already: what `send_now` hands back for an instant send."""

    def then(self, callback: Callable[[], None]) -> None:
        callback()

    def result(self) -> Any:
        return 1


class _Instant(MemoryBackend):
    """A backend whose every waited-for `send` is answered at once, in the data callback."""

    def send_now(  # type: ignore[override]  # the fake's None means "dispatch it"
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
    ) -> _Answered:
        return _Answered()


async def control_layer(tmp: Path, clients: int = 16, sends: int = 500) -> list[dict[str, Any]]:
    """Return the event loop's CPU and calls per `send` of the control socket alone."""
    path = tmp / "control.sock"
    figures: list[dict[str, Any]] = []
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: serve(_Instant(), socket_path=path,
                                                 task_status=task_status))  # fmt: skip
        await anyio.to_thread.run_sync(_clients, path, "warm", clients, 20)
        per_send = []
        for _ in range(CONTROL_LAYER_ROUNDS):  # the best round: the box's noise only adds
            cpu = time.thread_time()  # this thread runs the event loop, the clients their own
            done = len(await anyio.to_thread.run_sync(_clients, path, "cpu", clients, sends))
            per_send.append((time.thread_time() - cpu) / done)
        profile = cProfile.Profile()  # only this thread's calls: the loop's
        profile.enable()
        profiled = len(await anyio.to_thread.run_sync(_clients, path, "calls", clients, sends))
        profile.disable()
        tg.cancel_scope.cancel()
    calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    context = {"bench": "control", "mode": "in_process", "clients": clients, "sends_each": sends}
    measured = {
        "control_layer_loop_cpu_per_send_us": ("us", round(min(per_send) * 1e6, 1)),
        "control_layer_loop_calls_per_send": ("", round(calls / profiled, 1)),
    }
    for metric, (unit, value) in measured.items():
        figures.append({"metric": metric, "unit": unit, "value": value, "target": None, **context})
    return figures
