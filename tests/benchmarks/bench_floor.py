"""Floor benchmark: what this machine's kernel charges for the hand-offs no daemon can avoid.

A fired timer whose step runs on a worker thread costs the event loop at least one hand-off
to that thread and back (and one to the store's writer and back per commit); a durable
callback costs at least one round trip over the control socket. None of that is Python
work: it is the kernel waking a thread on the other core and being woken back, which on a
virtual machine whose idle cores halt (no halt polling) means an inter-processor interrupt
and an exit to the host each time. These figures measure that floor with nothing of
workflowd's on top, so that the daemon's own figures (`bench_timers`, `bench_control`) can
be read against the machine they ran on:

- `handoff_bare_loop_cpu_us`: an asyncio loop releases a lock a thread sleeps on, the
  thread writes a byte to a pipe the loop watches; the loop thread's CPU per round trip.
- `handoff_workers_loop_cpu_us`: the same through the daemon's own `Workers` (one trivial
  job at a time, awaited): the floor plus what the pool adds.
- `socket_bare_server_cpu_per_round_trip_{n}_clients_us`: a bare Python server process (an
  epoll loop that answers each line with a fixed line, parsing nothing, storing nothing)
  driven by `bench_control`'s own blocking clients; the server's CPU per round trip, and
  the round trips a second one core would give it at that cost
  (`socket_bare_server_ceiling_{n}_clients_per_s`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio

from daemon.runtime.workers import Workers

from .bench_control import _clients
from .bench_timers import loop_cpu_s

HANDOFFS = 20_000
#: clients -> round trips per client
SOCKET_ROUNDS: dict[int, int] = {1: 5_000, 16: 1_000}

#: The bare server: accepts on the socket path it is given, answers every line it reads.
_SERVER = r"""
import selectors, socket, sys
path, clients = sys.argv[1], int(sys.argv[2])
answer = b'{"id":1,"ok":true,"result":1}\n'
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen(64)
print("ready", flush=True)
sel = selectors.EpollSelector()
buf = bytearray(65536)
conns = [listener.accept()[0] for _ in range(clients)]
for c in conns:
    c.setblocking(False)
    sel.register(c, selectors.EVENT_READ)
open_ = len(conns)
while open_:
    for key, _ in sel.select():
        c = key.fileobj
        n = c.recv_into(buf)
        if not n:
            sel.unregister(c)
            c.close()
            open_ -= 1
            continue
        c.send(answer * buf[:n].count(b"\n"))
"""


def _figure(metric: str, value: float, unit: str, **context: Any) -> dict[str, Any]:
    return {"bench": "floor", "metric": metric, "value": value, "unit": unit, "target": None,
            **context}  # fmt: skip


async def _bare_handoffs(n: int) -> float:
    """Return the loop thread's CPU seconds per bare loop -> thread -> loop round trip."""
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    os.set_blocking(r, False)
    go = threading.Lock()
    go.acquire()
    stop = False
    answered: list[asyncio.Future[None]] = []

    def thread() -> None:
        while True:
            go.acquire()
            if stop:
                return
            os.write(w, b"\0")

    def on_answer() -> None:
        os.read(r, 64)
        answered.pop().set_result(None)

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    loop.add_reader(r, on_answer)
    try:
        start = time.thread_time()
        for _ in range(n):
            answered.append(loop.create_future())
            go.release()
            await answered[-1]
        return (time.thread_time() - start) / n
    finally:
        stop = True
        go.release()
        t.join()
        loop.remove_reader(r)
        os.close(r)
        os.close(w)


async def _workers_handoffs(n: int) -> float:
    """Return the loop thread's CPU seconds per trivial job run through `Workers`."""
    workers = Workers()
    try:
        for _ in range(100):  # the thread exists before it is measured
            await workers.submit(int).future
        start = time.thread_time()
        for _ in range(n):
            await workers.submit(int).future
        return (time.thread_time() - start) / n
    finally:
        workers.close()


def _bare_server(path: Path, clients: int, sends: int) -> float:
    """Return the bare server's CPU seconds per round trip with `clients` clients."""
    with subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(path), str(clients)], stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            raise RuntimeError("the bare server did not start")
        before = loop_cpu_s(proc.pid)
        done = len(_clients(path, "bare", clients, sends))  # the server reads no ids
        used = loop_cpu_s(proc.pid) - before  # read before the server ends (its clients are gone)
        proc.wait(timeout=30)
    return used / done


async def run(
    tmp: Path, handoffs: int = HANDOFFS, rounds: dict[int, int] | None = None
) -> list[dict[str, Any]]:
    """Measure the bare hand-off and socket round-trip floors of this machine."""
    figures = [
        _figure(
            "handoff_bare_loop_cpu_us",
            round(await _bare_handoffs(handoffs) * 1e6, 1),
            "us",
            handoffs=handoffs,
        ),
        _figure(
            "handoff_workers_loop_cpu_us",
            round(await _workers_handoffs(handoffs) * 1e6, 1),
            "us",
            handoffs=handoffs,
        ),
    ]
    for clients, sends in (rounds or SOCKET_ROUNDS).items():
        path = tmp / f"bare{clients}.sock"
        per = await anyio.to_thread.run_sync(_bare_server, path, clients, sends)
        context = {"clients": clients, "sends_each": sends}
        figures += [
            _figure(
                f"socket_bare_server_cpu_per_round_trip_{clients}_clients_us",
                round(per * 1e6, 1),
                "us",
                **context,
            ),
            _figure(
                f"socket_bare_server_ceiling_{clients}_clients_per_s",
                round(1 / per),
                "1/s",
                **context,
            ),
        ]
    return figures
