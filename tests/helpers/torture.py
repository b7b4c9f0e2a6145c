"""Crash torture: drive a real workflowd under load, SIGKILL it at random moments, check the data.

Shared by tests/e2e/test_reliability.py (a short run) and tests/benchmarks/bench_torture.py (a
long one). `torture(tmp, plan)` starts the daemon on a state folder of its own, starts the
workflows of tests/workflows/torture.py through the control socket, sends signals and socket
messages while a killer task SIGKILLs (now and then SIGTERMs) and restarts the daemon, waits for
every workflow to finish, stops the daemon and returns a Report whose `problems` must be empty.
"""

from __future__ import annotations

import json
import random
import re
import signal
import sqlite3
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from daemon.runtime.pipeline import AHEAD
from tests.helpers.client import Client
from tests.helpers.harness import Daemon, write_config
from tests.workflows.torture import FLAKY_EVERY

#: Steps of one thread a kill may leave undurable: a write in flight and one queued, each for
#: at most AHEAD checkpoints, and the step running (README: durability).
RERUN = 2 * AHEAD + 1

MODULES = ["tests.workflows.torture"]
_GONE = (OSError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)
_FINAL = ("Finished", "Failed", "Cancelled")


@dataclass
class Plan:
    """How hard to torture: how many workflows of each kind, kills and their pacing."""

    seed: int = 1
    kills: int = 5
    #: Every n-th restart is a graceful SIGTERM instead of a kill (0: never).
    graceful_every: int = 0
    #: Every n-th kill lands before the restarted daemon is ready (0: never).
    early_every: int = 3
    kill_gap_s: tuple[float, float] = (0.4, 1.2)
    loopers: int = 24
    fans: int = 6
    sleepers: int = 8
    collectors: int = 8
    doors: int = 6
    values: int = 6
    loop_n: int = 12
    #: Starts are spread over this long, so that kills land while work is in flight.
    start_over_s: float = 3.0
    finish_limit_s: float = 60.0


@dataclass
class Report:
    """What a torture run did and every broken promise it found."""

    kills: int = 0
    graceful: int = 0
    workflows: int = 0
    steps: int = 0
    step_runs: int = 0
    duplicate_runs: int = 0
    failed_runs: int = 0
    acked_sends: int = 0
    unacked_sends: int = 0
    acked_knocks: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """Return the numbers as one flat record (the benchmark runner's format)."""
        out = {k: v for k, v in vars(self).items() if k != "problems"}
        return {**out, "problems": len(self.problems)}


class Link:
    """A control connection that reconnects after the daemon died; None means outcome unknown."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.client: Client | None = None

    async def request(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """Send one request; return its response, or None if the connection broke first."""
        if self.client is None:
            with anyio.fail_after(60):
                while self.client is None:
                    try:
                        self.client = Client(await anyio.connect_unix(self.socket))
                    except OSError:
                        await anyio.sleep(0.05)
        try:
            return await self.client.request(op, **fields)
        except (*_GONE, json.JSONDecodeError):
            await self.close()
            return None

    async def until_ok(self, op: str, **fields: Any) -> dict[str, Any]:
        """Repeat a request whose repetition is harmless until it gets a response."""
        while True:
            response = await self.request(op, **fields)
            if response is not None:
                return response
            await anyio.sleep(0.05)

    async def close(self) -> None:
        """Drop the connection."""
        if self.client is not None:
            client, self.client = self.client, None
            await client.stream.aclose()


def _workflows(tmp: Path, plan: Plan) -> list[tuple[str, str, dict[str, Any]]]:
    out: list[tuple[str, str, dict[str, Any]]] = []
    for kind, count in (
        ("Looper", plan.loopers),
        ("Fan", plan.fans),
        ("Sleeper", plan.sleepers),
        ("Collector", plan.collectors),
        ("Door", plan.doors),
    ):
        for n in range(count):
            wid = f"{kind.lower()}{n}"
            extra: dict[str, Any] = {"Looper": {"n": plan.loop_n}, "Door": {}}.get(kind, {})
            if kind == "Door":
                extra = {"path": str(tmp / "listen" / f"{wid}.sock")}
            out.append((kind, wid, {"id": wid, **extra}))
    random.Random(plan.seed).shuffle(out)
    return out


class Torture:
    """One torture run: the daemon, the load tasks, the killer and what they saw."""

    def __init__(self, tmp: Path, plan: Plan) -> None:
        self.tmp, self.plan = tmp, plan
        self.state = tmp / "state"
        self.steplog = tmp / "steps.log"
        for d in (self.state, tmp / "listen"):
            d.mkdir(parents=True, exist_ok=True)
        config = write_config(
            tmp,
            MODULES,
            daemon={"socket": str(self.state / "wd.sock")},
            store={"path": str(self.state / "wd.db")},
        )
        self.daemon = Daemon(tmp, config, {"E2E_STEP_LOG": str(self.steplog)})
        self.daemon.socket = self.state / "wd.sock"
        self.workflows = _workflows(tmp, plan)
        self.started: dict[str, anyio.Event] = {w: anyio.Event() for _, w, _ in self.workflows}
        self.killed: set[int] = set()
        self.graceful: set[int] = set()
        self.sent: dict[str, list[int]] = defaultdict(list)
        self.acked: dict[str, dict[int, int | None]] = defaultdict(dict)
        self.knocked: set[str] = set()
        self.unacked = 0
        self.final: dict[str, dict[str, Any]] = {}
        self.report = Report(workflows=len(self.workflows))

    def problem(self, text: str) -> None:
        """Record a broken promise."""
        self.report.problems.append(text)

    async def run(self) -> Report:
        """Run the whole torture and return the report."""
        begin = time.monotonic()
        await self.daemon.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._starter)
                for kind, wid, _ in self.workflows:
                    if kind == "Collector":
                        tg.start_soon(self._collect, wid)
                    elif kind == "Door":
                        tg.start_soon(self._knock, wid)
                await self._killer()
            await self._wait_all_final()
            await self._check_live()
        finally:
            proc = self.daemon.proc
            code = await self.daemon.stop() if proc is not None else 0
            if code != 0:
                self.problem(f"final SIGTERM: workflowd exited {code}")
        self._check_stopped()
        self._check_steps()
        self.report.seconds = round(time.monotonic() - begin, 1)
        return self.report

    # -- load -------------------------------------------------------------------------------

    async def _starter(self) -> None:
        rng = random.Random(f"{self.plan.seed}-starter")
        link = Link(self.daemon.socket)
        gap = self.plan.start_over_s / max(1, len(self.workflows))
        for kind, wid, input in self.workflows:
            await anyio.sleep(rng.uniform(0, 2 * gap))
            response = await link.until_ok("start", workflow=kind, workflow_id=wid, input=input)
            if not response["ok"] and response["error"]["code"] != "unavailable":
                self.problem(f"start {wid}: {response}")
            elif not response["ok"]:
                response = await self._retry_start(link, kind, wid, input)
            self.started[wid].set()
        await link.close()

    async def _retry_start(
        self, link: Link, kind: str, wid: str, input: dict[str, Any]
    ) -> dict[str, Any]:
        while True:  # a daemon shutting down refuses starts: try the next one
            await anyio.sleep(0.05)
            response = await link.until_ok("start", workflow=kind, workflow_id=wid, input=input)
            if response["ok"]:
                return response

    async def _collect(self, wid: str) -> None:
        rng = random.Random(f"{self.plan.seed}-{wid}")
        link = Link(self.daemon.socket)
        await self.started[wid].wait()
        base = int(wid.removeprefix("collector")) * 10_000
        for n in range(self.plan.values * 3):  # unacknowledged values are not sent again
            if len(self.acked[wid]) >= self.plan.values:
                break
            await anyio.sleep(rng.uniform(0, 0.15))
            value, wait = base + n, rng.random() < 0.7
            self.sent[wid].append(value)
            response = await link.request(
                "send", workflow_id=wid, event="add", input=value, wait=wait
            )
            if response is not None and response["ok"]:
                self.acked[wid][value] = response["result"] if wait else None
            else:
                self.unacked += 1
        while True:
            response = await link.until_ok("send", workflow_id=wid, event="close")
            if response["ok"]:
                break
            shown = await link.until_ok("show", workflow_id=wid)
            if shown["ok"] and shown["result"]["data"]["closed"]:
                break  # the close was applied but its answer was lost in a kill
            await anyio.sleep(0.05)
        await link.close()

    async def _knock(self, wid: str) -> None:
        rng = random.Random(f"{self.plan.seed}-{wid}")
        await self.started[wid].wait()
        path = self.tmp / "listen" / f"{wid}.sock"
        if rng.random() < 0.3:
            return  # this door times out
        await anyio.sleep(rng.uniform(0, 0.8))
        deadline = anyio.current_time() + 3.0
        while anyio.current_time() < deadline:
            try:
                async with await anyio.connect_unix(path) as stream:
                    await stream.send(json.dumps({"knock": wid}).encode() + b"\n")
                    answer = b""
                    while not answer.endswith(b"\n"):
                        answer += await stream.receive()
                reply = json.loads(answer)
                if reply.get("ok"):
                    self.knocked.add(wid)
                    return
                if reply.get("error", {}).get("code") == "stale":
                    return  # the timer won
            except (*_GONE, json.JSONDecodeError):
                pass
            await anyio.sleep(0.03)

    async def _killer(self) -> None:
        plan, d, report = self.plan, self.daemon, self.report
        rng = random.Random(f"{plan.seed}-killer")
        n = 0
        while report.kills < plan.kills:
            n += 1
            await anyio.sleep(rng.uniform(*plan.kill_gap_s))
            assert d.proc is not None
            pid = d.proc.pid
            if plan.graceful_every and n % plan.graceful_every == 0:
                code = await d.stop(signal.SIGTERM)
                self.graceful.add(pid)
                report.graceful += 1
                if code != 0:
                    self.problem(f"SIGTERM #{n}: workflowd {pid} exited {code}")
            else:
                await d.kill()
                self.killed.add(pid)
                report.kills += 1
            early = plan.early_every and n % plan.early_every == 0
            if early and report.kills < plan.kills:
                proc = d.spawn()  # killed again before it is ready, maybe mid-recovery
                await anyio.sleep(rng.uniform(0.05, 0.6))
                if proc.poll() is not None:
                    self.problem(f"workflowd {proc.pid} died on its own: {proc.returncode}")
                await d.kill()
                self.killed.add(proc.pid)
                report.kills += 1
            await d.start()

    async def _wait_all_final(self) -> None:
        link = Link(self.daemon.socket)
        try:
            with anyio.fail_after(self.plan.finish_limit_s):
                while True:
                    rows = []
                    response = await link.until_ok("list", limit=1000)
                    rows += response["result"]
                    while "cursor" in response:  # a list answers 1000 rows at most
                        response = await link.until_ok(
                            "list", limit=1000, cursor=response["cursor"]
                        )
                        rows += response["result"]
                    if len(rows) == len(self.workflows) and all(
                        r["status"] in _FINAL for r in rows
                    ):
                        return
                    await anyio.sleep(0.1)
        except TimeoutError:
            stuck = [r["workflow_id"] for r in rows if r["status"] not in _FINAL]
            self.problem(f"not finished after {self.plan.finish_limit_s}s: {stuck[:10]}")
        finally:
            await link.close()

    # -- checks -----------------------------------------------------------------------------

    async def _check_live(self) -> None:
        """Check every workflow's data, then that no listener outlived its wait."""
        link = Link(self.daemon.socket)
        for kind, wid, _ in self.workflows:
            shown = (await link.until_ok("show", workflow_id=wid))["result"]
            if shown["status"] != "Finished" or shown["error"]:
                self.problem(f"{wid}: {shown['status']} {shown['error']}")
                continue
            self.final[wid] = shown["data"]
            self._check_data(kind, wid, shown["data"])
        await link.close()
        listen = str(self.tmp / "listen")
        table = await anyio.Path("/proc/net/unix").read_text()
        bound = [line.split()[-1] for line in table.splitlines() if listen in line]
        if bound:
            self.problem(f"listeners still bound after every wait ended: {bound}")

    def _check_data(self, kind: str, wid: str, data: dict[str, Any]) -> None:
        n = self.plan.loop_n
        want: dict[str, Any] = {}
        if kind == "Looper":
            want = {"i": n, "total": sum(range(n))}
        elif kind == "Fan":
            want = {"counts": [data["m"]] * 3, "finished": True}
        elif kind == "Sleeper":
            want = {"ticks": data["n"]}
        elif kind == "Door":
            self.report.acked_knocks += wid in self.knocked
            if data["how"] not in ("knock", "timeout") or (
                wid in self.knocked and data["how"] != "knock"
            ):
                self.problem(
                    f"{wid}: how={data['how']!r}, knock acknowledged: {wid in self.knocked}"
                )
        else:
            self._check_collector(wid, data)
        for key, value in want.items():
            if data[key] != value:
                self.problem(f"{wid}: {key} = {data[key]!r}, a crash-free run gives {value!r}")

    def _check_collector(self, wid: str, data: dict[str, Any]) -> None:
        got: list[int] = data["got"]
        acked = self.acked[wid]
        self.report.acked_sends += len(acked)
        self.report.unacked_sends = self.unacked
        dups = [v for v, c in Counter(got).items() if c > 1]
        if dups:
            self.problem(f"{wid}: values applied more than once: {dups}")
        if not set(got) <= set(self.sent[wid]):
            self.problem(f"{wid}: values never sent: {sorted(set(got) - set(self.sent[wid]))}")
        for value, reply in acked.items():
            if value not in got:
                self.problem(f"{wid}: acknowledged value {value} is not in the data")
            elif reply is not None and got.index(value) + 1 != reply:
                self.problem(f"{wid}: value {value} answered {reply}, is #{got.index(value) + 1}")
        expected = {"total": sum(got), "counted": len(got), "closed": True, "ticks": 2}
        for key, value in expected.items():
            if data[key] != value:
                self.problem(f"{wid}: {key} = {data[key]!r}, expected {value!r}")

    def _check_stopped(self) -> None:
        """After the final stop: no socket file, no stray state file, no pending inbox row."""
        left = sorted(p.name for p in (self.tmp / "listen").iterdir())
        if left:
            self.problem(f"socket files left in the listen folder: {left}")
        stray = sorted({p.name for p in self.state.iterdir()} - {"wd.db", "wd.db.lock"})
        if stray:
            self.problem(f"stray files in the state folder: {stray}")
        with sqlite3.connect(self.state / "wd.db") as db:
            (check,) = db.execute("PRAGMA integrity_check").fetchone()
            (inbox,) = db.execute("SELECT COUNT(*) FROM inbox").fetchone()
        db.close()
        if check != "ok":
            self.problem(f"integrity_check: {check}")
        if inbox:
            self.problem(f"{inbox} inbox rows never applied")

    def _check_steps(self) -> None:
        """Every expected step ran; a step ran again only if a kill cut its first run short."""
        runs: dict[tuple[str, str], list[int]] = defaultdict(list)
        # Threads of one workflow run steps at the same time, and each one's next step runs
        # while its previous checkpoint commits: a kill may cut short the steps after each
        # thread's last durable checkpoint, so each thread's last steps in a killed daemon (at
        # most RERUN of them) may run again.
        ran_in: dict[tuple[str, int, str], list[str]] = defaultdict(list)
        for line in self.steplog.read_text().splitlines():
            wid, key, ran_by, kind = line.split()
            if kind == "fail":
                self.report.failed_runs += 1
                continue
            runs[(wid, key)].append(int(ran_by))
            ran_in[(wid, int(ran_by), _thread_of(key))].append(key)
        self.report.steps = len(runs)
        self.report.step_runs = sum(len(p) for p in runs.values())
        self.report.duplicate_runs = self.report.step_runs - len(runs)
        extra_by: Counter[tuple[str, int, str]] = Counter()
        for (wid, key), pids in runs.items():
            for pid in pids[:-1]:
                extra_by[(wid, pid, _thread_of(key))] += 1
                if pid not in self.killed:
                    self.problem(f"{wid} {key} ran again after daemon {pid} stopped cleanly")
                elif key not in ran_in[(wid, pid, _thread_of(key))][-RERUN:]:
                    self.problem(f"{wid} {key}: checkpointed in daemon {pid}, yet ran again")
        for (wid, pid, thread), count in extra_by.items():
            if count > RERUN:
                self.problem(f"{wid}: {count} steps of {thread} cut short in daemon {pid}")
        self._check_expected_steps(set(runs))

    def _check_expected_steps(self, keys: set[tuple[str, str]]) -> None:
        for kind, wid, _ in self.workflows:
            want: set[str] = set()
            n = self.plan.loop_n
            if kind == "Looper":
                want = {f"{s}{i}" for s in ("work", "note") for i in range(n)}
                want |= {f"flaky{i}" for i in range(n) if i % FLAKY_EVERY == 2}
            elif kind == "Fan":
                want = {f"t{j}_{c}" for j in range(3) for c in range(4)} | {"finish"}
            elif kind == "Sleeper":
                want = {f"tick{t}" for t in range(3)}
            elif kind == "Door":
                want = {"enter"}
            else:
                got = len(self.final.get(wid, {}).get("got", []))
                want = {f"count{c}" for c in range(1, got + 1)} | {"count_close", "tock0", "tock1"}
                want |= {"done"}
            have = {k for w, k in keys if w == wid}
            if have != want:
                self.problem(f"{wid}: steps {sorted(have ^ want)} differ from a crash-free run")


async def torture(tmp: Path, plan: Plan | None = None) -> Report:
    """Run one crash torture under `tmp` and return its report."""
    return await Torture(tmp, plan or Plan()).run()


def daemon_errors(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the log records at error level or worse."""
    return [r for r in records if r.get("level") in ("error", "critical")]


def _thread_of(key: str) -> str:
    """Return the thread of tests/workflows/torture.py a step key was recorded by."""
    if (m := re.match(r"(t\d+)_\d+$", key)) is not None:
        return m.group(1)  # Fan's threads: t<j>_<n>
    return "ticker" if key.startswith("tock") else "main"  # Collector's ticker thread
