"""The crash torture's disk-full phase: fill the database's disk again and again under load.

Shared by tests/e2e/test_faults.py (a short run) and tests/benchmarks/bench_torture.py (a long
one). `disk_full_torture(tmp, plan)` mounts a small tmpfs for the database, starts Collector
workflows (tests/workflows/torture.py) and sends each a stream of values, with and without
`--no-wait`, while a filler task fills the disk to the last byte and frees it again. Then it
closes every Collector and, before any restart, checks that every acknowledged value was
applied, once, in the order it was acknowledged; a restart afterwards tells a stranded value
(applied only after a restart, or never) from a lost one. Where no tmpfs can be mounted, the
report says why in `skipped` and holds no figures.
"""

from __future__ import annotations

import bisect
import random
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from tests.helpers.disk import MountRefused, fill, tmpfs
from tests.helpers.harness import Daemon, write_config
from tests.helpers.torture import MODULES, Link


@dataclass
class FullPlan:
    """How hard to fill: Collectors, values each, how often and how long the disk is full."""

    seed: int = 1
    collectors: int = 8
    #: Values each Collector is sent after the last fill (all of them while it is free).
    tail: int = 3
    fills: int = 4
    full_s: tuple[float, float] = (0.3, 1.0)
    free_s: tuple[float, float] = (0.3, 1.0)
    #: Pause between two sends of one Collector.
    send_gap_s: tuple[float, float] = (0.0, 0.04)
    #: Share of sends that wait for the reply (the rest are `--no-wait`).
    wait_share: float = 0.5
    size: str = "24m"
    finish_limit_s: float = 60.0


@dataclass
class FullReport:
    """What the disk-full phase did, and every broken promise it found."""

    fills: int = 0
    collectors: int = 0
    acked_sends: int = 0
    acked_no_wait: int = 0
    refused_sends: int = 0
    #: Acknowledged, and not in the data even after a restart.
    lost: int = 0
    #: Acknowledged, and applied in another order than they were acknowledged.
    out_of_order: int = 0
    #: Acknowledged, and not applied by the time every workflow had finished (no restart).
    stranded: int = 0
    #: Refused with an error, and applied all the same.
    refused_but_applied: int = 0
    #: Times workflowd ended on its own during the phase.
    daemon_exits: int = 0
    checkpoint_failures: int = 0
    seconds: float = 0.0
    skipped: str = ""
    problems: list[str] = field(default_factory=list)


def out_of_place(seq: list[int]) -> int:
    """Return how many items must move for `seq` to be increasing (its length minus its LIS)."""
    tails: list[int] = []
    for x in seq:
        i = bisect.bisect_left(tails, x)
        tails[i : i + 1] = [x]
    return len(seq) - len(tails)


class DiskFull:
    """One disk-full phase: the daemon on a tmpfs, the senders, the filler and what they saw."""

    def __init__(self, tmp: Path, disk: Path, plan: FullPlan) -> None:
        self.tmp, self.disk, self.plan = tmp, disk, plan
        config = write_config(tmp, MODULES, store={"path": str(disk / "wd.db")})
        self.daemon = Daemon(tmp, config, {"E2E_STEP_LOG": str(tmp / "steps.log")})
        self.ids = [f"collector{n}" for n in range(plan.collectors)]
        #: Per Collector, the acknowledged values in the order acknowledged: value -> reply.
        self.acked: dict[str, dict[int, int | None]] = {w: {} for w in self.ids}
        self.refused: dict[str, set[int]] = {w: set() for w in self.ids}
        self.filling = True
        self.report = FullReport(collectors=plan.collectors)

    def problem(self, text: str) -> None:
        """Record a broken promise."""
        self.report.problems.append(text)

    async def run(self) -> FullReport:
        """Run the phase and return its report."""
        begin = time.monotonic()
        await self.daemon.start()
        try:
            link = Link(self.daemon.socket)
            for wid in self.ids:
                response = await link.until_ok("start", workflow="Collector", workflow_id=wid)
                if not response["ok"]:
                    self.problem(f"start {wid}: {response}")
            await link.close()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch)
                async with anyio.create_task_group() as senders:
                    for n, wid in enumerate(self.ids):
                        senders.start_soon(self._send, wid, n)
                    await self._filler()
                tg.cancel_scope.cancel()
            before = await self._close_all()
            self._check(before, restarted=False)
            code = await self.daemon.stop()
            if code != 0:
                self.problem(f"SIGTERM after the phase: workflowd exited {code}")
            await self.daemon.start()
            after = await self._close_all()
            self._check(after, restarted=True)
        finally:
            if self.daemon.proc is not None and self.daemon.proc.poll() is None:
                await self.daemon.stop()
        self._check_store()
        records = self.daemon.records()
        self.report.checkpoint_failures = sum(r["event"] == "checkpoint_failed" for r in records)
        self.report.seconds = round(time.monotonic() - begin, 1)
        return self.report

    async def _filler(self) -> None:
        plan, rng = self.plan, random.Random(f"{self.plan.seed}-filler")
        for _ in range(plan.fills):
            await anyio.sleep(rng.uniform(*plan.free_s))
            ballast = await anyio.to_thread.run_sync(fill, self.disk)
            self.report.fills += 1
            await anyio.sleep(rng.uniform(*plan.full_s))
            await anyio.Path(ballast).unlink()
        self.filling = False

    async def _watch(self) -> None:
        """Count (and restart) a daemon that ends on its own: that must never happen."""
        while True:
            proc = self.daemon.proc
            if proc is not None and proc.poll() is not None:
                self.report.daemon_exits += 1
                self.problem(f"workflowd {proc.pid} exited on its own: {proc.returncode}")
                await self.daemon.start()
            await anyio.sleep(0.05)

    async def _send(self, wid: str, n: int) -> None:
        plan, rng = self.plan, random.Random(f"{self.plan.seed}-{wid}")
        link = Link(self.daemon.socket)
        value, tail = n * 100_000, plan.tail
        while self.filling or tail > 0:
            if not self.filling:
                tail -= 1
            await anyio.sleep(rng.uniform(*plan.send_gap_s))
            value += 1
            wait = rng.random() < plan.wait_share
            response = await link.request(
                "send", workflow_id=wid, event="add", input=value, wait=wait
            )
            if response is not None and response["ok"]:
                self.acked[wid][value] = response["result"] if wait else None
                self.report.acked_sends += 1
                self.report.acked_no_wait += not wait
            else:
                self.refused[wid].add(value)
                self.report.refused_sends += 1
        await link.close()

    async def _close_all(self) -> dict[str, list[int]]:
        """Close every Collector and return each one's values once all have finished."""
        link = Link(self.daemon.socket)
        got: dict[str, list[int]] = {}
        try:
            with anyio.fail_after(self.plan.finish_limit_s):
                for wid in self.ids:
                    got[wid] = await self._close(link, wid)
        except TimeoutError:
            self.problem(f"not finished after {self.plan.finish_limit_s}s: {sorted(got)}")
        finally:
            await link.close()
        return got

    async def _close(self, link: Link, wid: str) -> list[int]:
        while True:
            shown = (await link.until_ok("show", workflow_id=wid))["result"]
            if shown["status"] == "Finished":
                return list(shown["data"]["got"])
            if not shown["data"]["closed"]:
                await link.until_ok("send", workflow_id=wid, event="close")
            await anyio.sleep(0.05)

    def _check(self, got_by: dict[str, list[int]], *, restarted: bool) -> None:
        r = self.report
        for wid, got in got_by.items():
            acked, applied = self.acked[wid], set(got)
            missing = [v for v in acked if v not in applied]
            if restarted:
                r.lost += len(missing)
                if missing:
                    self.problem(f"{wid}: acknowledged values lost: {missing[:10]}")
                continue
            r.stranded += len(missing)
            if missing:
                self.problem(f"{wid}: acknowledged values not applied without a restart: {missing}")
            order = [v for v in got if v in acked]
            r.out_of_order += out_of_place(order)
            if order != sorted(order):
                self.problem(f"{wid}: acknowledged values applied out of order: {order}")
            dups = [v for v, c in Counter(got).items() if c > 1]
            if dups:
                self.problem(f"{wid}: values applied more than once: {dups}")
            wrong = [v for v, reply in acked.items() if reply is not None and v in applied
                     and got.index(v) + 1 != reply]  # fmt: skip
            if wrong:
                self.problem(f"{wid}: values answered with another position: {wrong}")
            refused = sorted(self.refused[wid] & applied)
            r.refused_but_applied += len(refused)
            if refused:
                self.problem(f"{wid}: refused values applied all the same: {refused}")

    def _check_store(self) -> None:
        with sqlite3.connect(self.disk / "wd.db") as db:
            (check,) = db.execute("PRAGMA integrity_check").fetchone()
            (inbox,) = db.execute("SELECT COUNT(*) FROM inbox").fetchone()
        db.close()
        if check != "ok":
            self.problem(f"integrity_check: {check}")
        if inbox:
            self.problem(f"{inbox} inbox rows never applied")


async def disk_full_torture(tmp: Path, plan: FullPlan | None = None) -> FullReport:
    """Run one disk-full phase under `tmp`; a report with `skipped` set where mount is refused."""
    plan = plan or FullPlan()
    try:
        async with tmpfs(tmp / "disk", plan.size) as disk:
            return await DiskFull(tmp, disk, plan).run()
    except MountRefused as e:
        return FullReport(skipped=str(e))
