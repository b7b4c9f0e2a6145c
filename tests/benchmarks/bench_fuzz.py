"""Protocol fuzzer: hostile input against a live workflowd for a fixed time budget.

It holds a thousand idle connections open, then throws deeply nested JSON, huge numbers,
invalid UTF-8, half-written lines, oversized lines, random bytes and random valid-looking
requests at the control socket from a few concurrent clients. A failure is: the daemon died,
it stopped answering ping, a complete line got no answer, or the data of the reference
workflows changed. Usage: `python -m tests.benchmarks.bench_fuzz [budget_s]`; the runner
calls `run()`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import socket
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from daemon.store import schema
from tests.helpers.client import Client
from tests.helpers.harness import Daemon, write_config
from tests.helpers.wait import wait_status

BUDGET_S = 60.0
IDLE = 1000
MAX_CONNECTIONS = 1200
WORKERS = 4
ANSWER_S = 10.0
OPS = ["ping", "start", "send", "list", "show", "history", "cancel", "logs", "nope", ""]
REFS = ("ref_c", "ref_l")


@dataclass
class Tally:
    """What the fuzzer tried and what went wrong."""

    tried: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    pings: int = 0

    def fail(self, why: str) -> None:
        """Record one failure (kept short)."""
        self.failures.append(why[:300])


def _nested(rng: random.Random) -> bytes:
    depth = rng.choice([64, 1000, 10_000, 100_000])  # lines stay under the 1 MiB limit
    if rng.random() < 0.5:
        inner = b"[" * depth + b"]" * depth
    else:
        inner = b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"id": 1, "op": "start", "workflow": "Collector", "input": {"x": ' + inner + b"}}"


def _huge(rng: random.Random) -> bytes:
    big = rng.choice(["1" + "0" * 5000, "-" + "9" * 400, "1e309", "-1e309", "18446744073709551616"])
    template = rng.choice(
        [
            '{"id": %s, "op": "ping"}',
            '{"id": 1, "op": "list", "limit": %s}',
            '{"id": 1, "op": "send", "workflow_id": "ref_c", "event": "nope", "pc": %s}',
            '{"id": 1, "op": "history", "workflow_id": "ref_l", "limit": %s}',
            '{"id": 1, "op": "start", "workflow": "Looper", "input": {"n": %s}}',
        ]
    )
    return (template % big).encode()


def _bad_utf8(rng: random.Random) -> bytes:
    junk = bytes(rng.choice([0xFF, 0xFE, 0xC0, 0xED, 0xA0, 0x80]) for _ in range(rng.randint(1, 8)))
    return rng.choice(
        [
            b'{"id": 1, "op": "show", "workflow_id": "' + junk + b'"}',
            b'{"id": "' + junk + b'", "op": "ping"}',
            b'{"id": 1, "op": "' + junk + b'"}',
            junk,
        ]
    )


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    makers: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.uniform(-1e300, 1e300),
        lambda: "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(0, 20))),
        lambda: rng.choice(
            ["", "ref_c", "ref_l", "Collector", "Looper", "add", "close", "x" * 300]
        ),
        lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))],
        lambda: {
            rng.choice(["id", "n", "got", "x", ""]): _random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 4))
        },
        lambda: {"id": "fz", "n": rng.randint(0, 3), "delay_s": 0.0},
    ]
    return makers[kind]()


def _plausible(rng: random.Random) -> bytes:
    """A request that looks valid; it never sends a real event to a reference workflow."""
    op = rng.choice(OPS)
    req: dict[str, Any] = {"id": rng.choice([1, "x", None, [], 2**40]), "op": op}
    fields: dict[str, Callable[[], Any]] = {
        "workflow": lambda: rng.choice(["Collector", "Looper", "Sleeper", "Nope", 5]),
        "workflow_id": lambda: rng.choice([f"fz{rng.randrange(50)}", "ref_c", "ref_l", "", None]),
        "event": lambda: rng.choice(["nope", "", "tick", 7]),
        "input": lambda: _random_value(rng),
        "limit": lambda: rng.choice([1, 0, -1, 10**6, 10**7, "5"]),
        "status": lambda: rng.choice(["Waiting", "Finished", "", 3]),
        "wait": lambda: rng.random() < 0.5,
        "pc": lambda: rng.choice([0, 1, -5, 2**63]),
        "thread_id": lambda: rng.choice(["_main_", "", "ticker", 1]),
        "follow": lambda: False,
        "extra": lambda: _random_value(rng),
    }
    for name in rng.sample(sorted(fields), rng.randint(0, 5)):
        req[name] = fields[name]()
    if op == "send" and req.get("workflow_id") in REFS:
        req["event"] = "nope"  # reference workflows only see events they reject
    if op == "cancel" and req.get("workflow_id") in REFS:
        req["workflow_id"] = "fz0"
    if op == "logs":
        req["follow"] = False
    if op == "start" and req.get("workflow_id") in REFS:
        req["workflow_id"] = None
    return msgspec.json.encode(req)


def _random_bytes(rng: random.Random) -> bytes:
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))).replace(b"\n", b" ")
    return junk if junk.strip() else b"x" + junk  # a blank line is skipped, by design


GENERATORS: dict[str, Callable[[random.Random], bytes]] = {
    "nested": _nested,
    "huge_number": _huge,
    "invalid_utf8": _bad_utf8,
    "plausible": _plausible,
    "random_bytes": _random_bytes,
}


async def _answer(stream: anyio.abc.SocketStream) -> bytes:
    data = b""
    with anyio.fail_after(ANSWER_S):
        while not data.endswith(b"\n"):
            data += await stream.receive()
    return data


async def _one_line(socket: Path, line: bytes, tally: Tally, kind: str) -> None:
    """Send one complete line on a fresh connection and demand a JSON answer."""
    try:
        async with await anyio.connect_unix(socket) as stream:
            await stream.send(line + b"\n")
            answer = await _answer(stream)
    except TimeoutError:
        tally.fail(f"{kind}: no answer within {ANSWER_S}s to {line[:80]!r}")
        return
    except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as e:
        tally.fail(f"{kind}: connection broke ({type(e).__name__}) on {line[:80]!r}")
        return
    try:
        response = json.loads(answer.partition(b"\n")[0])  # `logs` answers with several lines
        assert isinstance(response, dict) and isinstance(response.get("ok"), bool)
    except (ValueError, AssertionError):
        tally.fail(f"{kind}: bad answer {answer[:120]!r} to {line[:80]!r}")


async def _half_line(socket: Path, rng: random.Random, tally: Tally) -> None:
    """Write part of a request, then hang up."""
    line = _plausible(rng)
    with contextlib.suppress(OSError, anyio.BrokenResourceError):
        async with await anyio.connect_unix(socket) as stream:
            await stream.send(line[: rng.randint(1, max(1, len(line) - 1))])


async def _oversized(socket: Path, tally: Tally) -> None:
    """A line over the limit gets too_large and that connection is closed."""
    try:
        async with await anyio.connect_unix(socket) as stream:
            with contextlib.suppress(anyio.BrokenResourceError):
                # The daemon may answer and hang up before it has read the whole line.
                await stream.send(b'{"op": "ping", "x": "' + b"y" * (1 << 20) + b'"}\n')
            answer = await _answer(stream)
        if json.loads(answer.partition(b"\n")[0])["error"]["code"] != "too_large":
            tally.fail(f"oversized: answered {answer[:120]!r}")
    except (TimeoutError, OSError, anyio.EndOfStream, anyio.BrokenResourceError, ValueError) as e:
        tally.fail(f"oversized: {type(e).__name__}: {e}")


async def _worker(n: int, socket: Path, deadline: float, tally: Tally) -> None:
    rng = random.Random(f"fuzz-{n}")
    kinds = [*GENERATORS, "half_line", "oversized"]
    weights = [1, 2, 2, 6, 2, 2, 0.1]
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        tally.tried[kind] += 1
        if kind == "half_line":
            await _half_line(socket, rng, tally)
        elif kind == "oversized":
            await _oversized(socket, tally)
        else:
            await _one_line(socket, GENERATORS[kind](rng), tally, kind)


async def _pinger(d: Daemon, deadline: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        if d.proc is None or d.proc.poll() is not None:
            tally.fail(f"workflowd died: exit {d.proc.returncode if d.proc else None}")
            return
        try:
            with anyio.fail_after(ANSWER_S):
                async with d.client() as c:
                    if not (await c.request("ping"))["ok"]:
                        tally.fail("ping answered with an error")
            tally.pings += 1
        except (TimeoutError, OSError, anyio.EndOfStream) as e:
            tally.fail(f"ping failed: {type(e).__name__}: {e}")
        await anyio.sleep(1.0)


async def _hold_idle(
    socket: Path, count: int, events: tuple[anyio.Event, anyio.Event], held: list[int]
) -> None:
    """Open `count` connections that never send anything, until the second event is set."""
    ready, done = events
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(count):
            stream = await anyio.connect_unix(socket)
            stack.push_async_callback(stream.aclose)
            held[0] += 1
        ready.set()
        await done.wait()


async def _references(c: Client) -> dict[str, Any]:
    await c.call("start", workflow="Collector", workflow_id="ref_c", input={"id": "ref_c"})
    await c.call("start", workflow="Looper", workflow_id="ref_l", input={"id": "ref_l", "n": 3})
    for value in (1, 2):
        await c.call("send", workflow_id="ref_c", event="add", input=value)
    await wait_status(c, "ref_l", "Finished")
    with anyio.fail_after(20):
        while True:  # once its timer thread is done, its data stays put
            if (await c.call("show", workflow_id="ref_c"))["data"]["ticks"] >= 2:
                break
            await anyio.sleep(0.05)
    return {wid: (await c.call("show", workflow_id=wid))["data"] for wid in REFS}


async def fuzz(tmp: Path, budget_s: float = BUDGET_S) -> tuple[Tally, int, float]:
    """Fuzz a fresh daemon under `tmp` for `budget_s` seconds; return tally, idle held, seconds."""
    tally, held = Tally(), [0]
    config = write_config(
        tmp,
        ["tests.workflows.torture"],
        daemon={"max_connections": MAX_CONNECTIONS, "idle_timeout_s": 600.0},
    )
    d = Daemon(tmp, config)
    await d.start()
    begin = time.monotonic()
    try:
        async with d.client() as c:
            before = await _references(c)
        idle_done, idle_ready = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_hold_idle, d.socket, IDLE, (idle_ready, idle_done), held)
            with anyio.fail_after(60):
                await idle_ready.wait()
            deadline = time.monotonic() + budget_s
            async with anyio.create_task_group() as load:
                load.start_soon(_pinger, d, deadline, tally)
                for n in range(WORKERS):
                    load.start_soon(_worker, n, d.socket, deadline, tally)
            idle_done.set()
        async with d.client() as c:
            if not (await c.request("ping"))["ok"]:
                tally.fail("no ping after the idle connections closed")
            after = {wid: (await c.call("show", workflow_id=wid))["data"] for wid in REFS}
        if after != before:
            tally.fail(f"reference data changed: {before} -> {after}")
    finally:
        code = await d.stop()
        if code != 0:
            tally.fail(f"workflowd exited {code} on SIGTERM")
    return tally, held[0], time.monotonic() - begin


#: The floods: how many clients each runs, and for how long.
SLOW_CLIENTS, SLOW_S, SLOW_GAP_S = 300, 15.0, 2.0
NON_READERS, NON_READER_S, ANSWER_BYTES = 40, 10.0, 300_000
CLOSERS, CLOSER_BURSTS = 300, 5
FORBIDDEN_S = 5.0
LIST_ROWS, LIST_SAMPLES = 100_000, 300


@dataclass
class Flood:
    """What one flood did: hostile connections or requests, and the pings it cost."""

    hostile: int = 0
    pings: int = 0
    refused: int = 0
    peak_rss: int = 0


def _rss(d: Daemon) -> int:
    """Return the daemon's resident set size in bytes (0 if it is gone)."""
    if d.proc is None:
        return 0
    try:
        status = Path(f"/proc/{d.proc.pid}/status").read_text()
    except OSError:
        return 0
    kb = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")), "0")
    return int(kb) * 1024


async def _watch(d: Daemon, flood: Flood, stop: anyio.Event) -> None:
    """Ping on a fresh connection every 0.1 s until `stop`; count refusals; sample RSS."""
    while not stop.is_set():
        flood.peak_rss = max(flood.peak_rss, _rss(d))
        flood.pings += 1
        try:
            with anyio.fail_after(ANSWER_S):
                async with d.client() as c:
                    if not (await c.request("ping"))["ok"]:
                        flood.refused += 1
        except (TimeoutError, OSError, anyio.EndOfStream, anyio.BrokenResourceError):
            flood.refused += 1
        with anyio.move_on_after(0.1):
            await stop.wait()


async def _during(d: Daemon, attack: Callable[[Flood], Any]) -> Flood:
    """Run `attack` while pinging; return what it cost."""
    flood, stop = Flood(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch, d, flood, stop)
        await attack(flood)
        stop.set()
    return flood


async def _quiet(flood: Flood) -> None:
    await anyio.sleep(2.0)  # no attack: the baseline pings and RSS


async def _slowloris(d: Daemon, flood: Flood) -> None:
    async def one() -> None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError):
            async with await anyio.connect_unix(d.socket) as stream:
                with anyio.move_on_after(SLOW_S):
                    while True:
                        await stream.send(b" ")
                        flood.hostile += 1
                        await anyio.sleep(SLOW_GAP_S)  # a byte every 2 s, the attack itself

    async with anyio.create_task_group() as tg:
        for _ in range(SLOW_CLIENTS):
            tg.start_soon(one)


async def _non_readers(d: Daemon, flood: Flood) -> None:
    asks = b"".join(b'{"op": "show", "workflow_id": "big", "id": %d}\n' % n for n in range(200))
    held = []
    try:
        for _ in range(NON_READERS):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(d.socket))
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError, ConnectionError):
                sent = sock.send(asks)
                flood.hostile += asks[:sent].count(b"\n")
            held.append(sock)
        await anyio.sleep(NON_READER_S)  # they hold their connections, never reading
    finally:
        for sock in held:
            sock.close()


#: Connect, send a line or a fragment, and close, argv[2] times as fast as possible.
BURST_CHILD = """
import socket, sys
for n in range(int(sys.argv[2])):
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(sys.argv[1])
            s.sendall(b'{"op": "ping"}\\n' if n % 2 else b'{"op": "pi')
        except OSError:
            pass
"""


async def _closers(d: Daemon, flood: Flood) -> None:
    for _ in range(CLOSER_BURSTS):
        # In a process of its own, as cron jobs are: the pinger here runs meanwhile.
        burst = [sys.executable, "-I", "-c", BURST_CHILD, str(d.socket), str(CLOSERS)]
        await anyio.run_process(burst)
        flood.hostile += CLOSERS
        await anyio.sleep(0.2)  # bursts a moment apart


async def _forbidden(d: Daemon, flood: Flood) -> None:
    drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    child = [*drop, sys.executable, "-I", "-c", FORBIDDEN_CHILD, str(d.socket), str(FORBIDDEN_S)]
    done = await anyio.run_process(child, check=False)
    flood.hostile += int(done.stdout or b"0")


#: Run as uid 65534: connect as fast as it can for argv[2] s, keeping 200 open; print the count.
FORBIDDEN_CHILD = """
import socket, sys, time
end, open_, n = time.monotonic() + float(sys.argv[2]), [], 0
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
    except OSError:
        s.close()
        continue
    n += 1
    open_.append(s)
    if len(open_) > 200:
        open_.pop(0).close()
print(n)
"""


def _fill(db: Path, rows: int) -> None:
    """Add `rows` ended workflows, with the state of the one there, changed in the last hour."""
    conn = sqlite3.connect(db)
    cols = schema.COLS
    (template,) = conn.execute(f"SELECT {cols} FROM workflows LIMIT 1").fetchall()
    now = time.time()
    marks = ", ".join("?" * len(template))
    conn.executemany(
        f"INSERT INTO workflows ({cols}) VALUES ({marks})",
        (
            (
                f"bulk{n}",
                "Tally",
                "Finished" if n % 10 else "Cancelled",
                "{}",  # small data: `list` reads the state, and the file stays small
                *template[4:8],
                now - 3600,
                now - 3600 + n * 0.03,
                *template[10:],  # parent, deadline: as the one there (none)
            )
            for n in range(rows)
        ),
    )
    conn.commit()
    conn.close()


async def _list_figures(d: Daemon) -> dict[str, float]:
    """Time `list` (100 rows) over the filled database, plain and filtered, and its pages."""
    out: dict[str, float] = {}
    async with d.client() as c:
        for name, fields in (
            ("list", {}),
            ("list_status", {"status": "Cancelled"}),
            ("list_workflow", {"workflow": "Tally"}),
        ):
            times = []
            cursor = None
            for _ in range(LIST_SAMPLES):
                began = time.perf_counter()
                response = await c.request(
                    "list", limit=100, **fields, **({"cursor": cursor} if cursor else {})
                )
                times.append(time.perf_counter() - began)
                cursor = response.get("cursor")
            out[f"{name}_p50_ms"] = round(statistics.median(times) * 1000, 2)
    # Four clients pipelining 64 lists of 1000 rows: how long does a ping wait meanwhile?
    asks = b"".join(b'{"op": "list", "limit": 1000, "id": %d}\n' % n for n in range(64))
    worst = 0.0
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(d.client()) for _ in range(4)]
        for c in clients:
            await c.stream.send(asks)

        async def drain(c: Client) -> None:
            for _ in range(64):
                await c.read()

        async with anyio.create_task_group() as tg:
            for c in clients:
                tg.start_soon(drain, c)
            for _ in range(20):
                began = time.perf_counter()
                async with d.client() as p:
                    await p.request("ping")
                worst = max(worst, time.perf_counter() - began)
    out["ping_during_list_flood_max_ms"] = round(worst * 1000, 1)
    return out


async def floods(tmp: Path) -> tuple[dict[str, Flood], dict[str, float], list[str]]:
    """Run each flood against a daemon with the default limits; return what each cost."""
    failures: list[str] = []
    config = write_config(tmp, ["tests.workflows.control"], daemon={"idle_timeout_s": 20.0})
    d = Daemon(tmp, config)
    await d.start()
    async with d.client() as c:
        await c.call(
            "start",
            workflow="Tally",
            workflow_id="big",
            input={"id": "big", "label": "x" * ANSWER_BYTES},
        )
        await wait_status(c, "big", "Waiting")
    await d.stop()
    _fill(tmp / "wd.db", LIST_ROWS)
    await d.start()
    results: dict[str, Flood] = {}
    try:
        async with d.client() as c:
            before = await c.call("show", workflow_id="big")
        results["quiet"] = await _during(d, _quiet)
        results["slowloris"] = await _during(d, functools.partial(_slowloris, d))
        results["non_reader"] = await _during(d, functools.partial(_non_readers, d))
        if os.geteuid() == 0 and shutil.which("setpriv"):
            os.chmod(tmp, 0o777)
            os.chmod(d.socket, 0o666)
            results["forbidden"] = await _during(d, functools.partial(_forbidden, d))
        results["closers"] = await _during(d, functools.partial(_closers, d))
        listing = await _list_figures(d)
        async with d.client() as c:
            after = await c.call("show", workflow_id="big")
            counts = (await c.call("ping"))["workflows"]
        if (after["data"], after["updated_at"]) != (before["data"], before["updated_at"]):
            failures.append("floods: the reference workflow changed")
        if sum(counts.values()) != LIST_ROWS + 1:
            failures.append(f"floods: stored rows changed: {counts}")
    finally:
        code = await d.stop()
        if code != 0:
            failures.append(f"floods: workflowd exited {code} on SIGTERM")
    return results, listing, failures


async def run(budget_s: float = BUDGET_S) -> list[dict[str, Any]]:
    """Run the fuzzer for `budget_s` seconds and return its figures; failures go to stderr."""
    with tempfile.TemporaryDirectory(prefix="bench_fuzz-") as tmp:
        tally, held, seconds = await fuzz(Path(tmp), budget_s)
    with tempfile.TemporaryDirectory(prefix="bench_floods-") as tmp:
        flooded, listing, flood_failures = await floods(Path(tmp))
    tally.failures += flood_failures
    shown: Counter[str] = Counter()
    for failure in tally.failures:
        kind = failure.partition(":")[0]
        shown[kind] += 1
        if shown[kind] <= 5:  # a few of each kind
            print(f"# fuzz failure: {failure}", file=sys.stderr)
    tried = sum(tally.tried.values())
    figures: list[dict[str, Any]] = [
        {"metric": "requests_tried", "value": tried, "unit": "", "target": None},
        {
            "metric": "requests_per_s",
            "value": round(tried / budget_s),
            "unit": "1/s",
            "target": None,
        },
        {"metric": "failures", "value": len(tally.failures), "unit": "", "target": 0},
        {"metric": "idle_connections_held", "value": held, "unit": "", "target": None},
        {"metric": "pings_answered", "value": tally.pings, "unit": "", "target": None},
        {"metric": "duration_s", "value": round(seconds, 1), "unit": "s", "target": None},
    ]
    figures += [
        {"metric": f"tried_{kind}", "value": n, "unit": "", "target": None}
        for kind, n in sorted(tally.tried.items())
    ]
    hostile = tried + sum(f.hostile for f in flooded.values())
    figures.append(
        {"metric": "hostile_requests_sent", "value": hostile, "unit": "", "target": None}
    )
    crashes = sum("died" in f or "exited" in f for f in tally.failures)
    figures.append({"metric": "crashes", "value": crashes, "unit": "", "target": 0})
    changed = sum("changed" in f for f in tally.failures)
    figures.append({"metric": "stored_rows_changed", "value": changed, "unit": "", "target": 0})
    for kind, flood in flooded.items():
        figures += [
            {"metric": f"{kind}_hostile", "value": flood.hostile, "unit": "", "target": None},
            {"metric": f"{kind}_pings", "value": flood.pings, "unit": "", "target": None},
            {"metric": f"{kind}_pings_refused", "value": flood.refused, "unit": "", "target": 0},
        ]
    for kind, target in (("quiet", None), ("non_reader", 300)):
        rss = round(flooded[kind].peak_rss / 2**20, 1)
        figures.append(
            {"metric": f"{kind}_peak_rss", "value": rss, "unit": "MiB", "target": target}
        )
    targets = {"list_p50_ms": 5, "list_status_p50_ms": 5, "list_workflow_p50_ms": 5}
    figures += [
        {"metric": k, "value": v, "unit": "ms", "target": targets.get(k)}
        for k, v in listing.items()
    ]
    by_kind = Counter(f.partition(":")[0].replace(" ", "_") for f in tally.failures)
    figures += [
        {"metric": f"failures_{kind}", "value": n, "unit": "", "target": 0}
        for kind, n in sorted(by_kind.items())
    ]
    return [{"bench": "fuzz", **f} for f in figures]


async def _main() -> None:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else BUDGET_S
    for fig in await run(budget):
        print(msgspec.json.encode(fig).decode(), flush=True)


if __name__ == "__main__":
    anyio.run(_main)
