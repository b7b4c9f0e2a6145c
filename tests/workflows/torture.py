"""Workflows the crash torture runs inside a real daemon; every step run appends to a log.

Each run of a step appends `workflow_id key pid kind` to $E2E_STEP_LOG, opened with O_APPEND so
lines survive a SIGKILL: `key` names the step and its iteration (unique per workflow in a
crash-free run), `pid` is the daemon that ran it (which tells the attempts apart), and `kind` is
`run`, or `fail` for a run that raises on purpose. The log is written when a step starts, so a
step cut short by a kill still shows.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from daemon import CallbackRequest, For, Go, If, On, S, Section, Step, Wait, WaitFor, Workflow
from handlers import Signal, SocketListen, Timer
from tests.workflows.e2e import append_step_log

#: The step that raises once per key fails on these iterations of a Looper.
FLAKY_EVERY = 5


def record(workflow_id: str, key: str, kind: str = "run") -> None:
    """Record one step run as `workflow_id key pid kind`."""
    append_step_log(f"{workflow_id} {key} {os.getpid()} {kind}")


def first_time(workflow_id: str, key: str) -> bool:
    """Tell whether this is the first run of `key` ever (a marker file beside the log)."""
    path = os.environ.get("E2E_STEP_LOG")
    if not path:
        return False
    markers = Path(f"{path}.d")
    markers.mkdir(exist_ok=True)
    try:
        os.close(os.open(markers / f"{workflow_id}-{key}", os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


@dataclass
class Looper(Workflow):
    """Loops `n` times over a sync step and an async step; one step in five fails once."""

    id: str = ""
    n: int = 12
    i: int = 0
    total: int = 0
    delay_s: float = 0.01

    def flaky(self) -> None:
        key = f"flaky{self.i}"
        if first_time(self.id, key):
            record(self.id, key, "fail")
            raise RuntimeError(f"{key} fails on its first run")
        record(self.id, key)

    def work(self) -> None:
        record(self.id, f"work{self.i}")
        time.sleep(self.delay_s)
        self.total += self.i

    async def note(self) -> None:
        record(self.id, f"note{self.i}")
        await anyio.sleep(self.delay_s)
        self.i += 1

    def definition(self) -> Section:
        return S(
            For(
                "loop",
                self.i < self.n,
                If(self.i % FLAKY_EVERY == 2, "flaky_turn", Step("flaky", self.flaky)),
                Step("work", self.work),
                Step("note", self.note),
            )
        )


@dataclass
class Fan(Workflow):
    """Three parallel threads each run `m` steps; the main thread waits for all of them."""

    id: str = ""
    m: int = 4
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    finished: bool = False
    delay_s: float = 0.01

    def bump(self, j: int) -> None:
        record(self.id, f"t{j}_{self.counts[j]}")
        time.sleep(self.delay_s)
        self.counts[j] += 1

    def finish(self) -> None:
        record(self.id, "finish")
        self.finished = True

    def definition(self) -> Section:
        threads = [
            Go(
                f"t{j}",
                For(
                    f"t{j}_loop", self.counts[j] < self.m, Step(f"t{j}_step", partial(self.bump, j))
                ),
            )
            for j in range(len(self.counts))
        ]
        return S(
            *threads,
            WaitFor("all", all(c >= self.m for c in self.counts)),
            Step("finish", self.finish),
        )


@dataclass
class Sleeper(Workflow):
    """Naps `n` times on a timer, with a step after each nap."""

    id: str = ""
    n: int = 3
    nap_s: float = 0.2
    ticks: int = 0

    def tick(self) -> None:
        record(self.id, f"tick{self.ticks}")
        self.ticks += 1

    def definition(self) -> Section:
        return S(
            For(
                "naps",
                self.ticks < self.n,
                Wait("nap", On("wake", Timer(after=self.nap_s))),
                Step("tick", self.tick),
            )
        )


@dataclass
class Collector(Workflow):
    """Takes `add` signals until `close`, while a parallel thread ticks twice on a timer."""

    id: str = ""
    got: list[int] = field(default_factory=list)
    total: int = 0
    counted: int = 0
    closed: bool = False
    ticks: int = 0
    done: bool = False

    def add(self, value: int) -> int:
        self.got.append(value)
        self.total += value
        return len(self.got)

    def close(self) -> int:
        self.closed = True
        return len(self.got)

    def count(self) -> None:
        record(self.id, "count_close" if self.closed else f"count{len(self.got)}")
        self.counted = len(self.got)

    def tock(self) -> None:
        record(self.id, f"tock{self.ticks}")
        self.ticks += 1

    def finish(self) -> None:
        record(self.id, "done")
        self.done = True

    def definition(self) -> Section:
        ticker = For(
            "ticks",
            self.ticks < 2,
            Wait("tick_wait", On("tick", Timer(after=0.2))),
            Step("tock", self.tock),
        )
        return S(
            Go("ticker", ticker),
            For(
                "collect",
                not self.closed,
                Wait("gate", On("add", Signal(self.add)), On("close", Signal(self.close))),
                Step("count", self.count),
            ),
            WaitFor("ticked", self.ticks >= 2),
            Step("done", self.finish),
        )


@dataclass
class Door(Workflow):
    """Waits for one message on its own Unix socket, or gives up after `patience_s`."""

    id: str = ""
    path: str = ""
    patience_s: float = 1.0
    how: str = ""

    def knocked(self) -> None:
        record(self.id, "enter")
        self.how = "knock"

    def timed_out(self) -> None:
        record(self.id, "enter")
        self.how = "timeout"

    def definition(self) -> Section:
        return S(
            Wait(
                "door",
                On("knock", SocketListen(path=self.path), Step("in_knock", self.knocked)),
                On("timeout", Timer(after=self.patience_s), Step("in_timeout", self.timed_out)),
            )
        )


@dataclass
class Filler(Workflow):
    """Appends `size` bytes of text to its data in each of `n` slow steps (fills a small disk)."""

    id: str = ""
    n: int = 10
    size: int = 16_384
    delay_s: float = 0.05
    chunks: list[str] = field(default_factory=list)

    def grow(self) -> None:
        record(self.id, f"grow{len(self.chunks)}")
        time.sleep(self.delay_s)
        self.chunks.append("x" * self.size)

    def definition(self) -> Section:
        return S(For("fill", len(self.chunks) < self.n, Step("grow", self.grow)))


class Touchy:
    """A handler whose setup (or teardown) raises while the file `marker`.setup (.teardown) exists."""

    type = "touchy"

    def __init__(self, marker: str) -> None:
        self.marker = marker

    async def setup(self, req: CallbackRequest) -> str:
        """Refuse while the setup marker exists."""
        if await anyio.Path(f"{self.marker}.setup").exists():
            raise RuntimeError("setup refused by marker")
        return ""

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Return the input."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Refuse while the teardown marker exists."""
        if await anyio.Path(f"{self.marker}.teardown").exists():
            raise RuntimeError("teardown refused by marker")


@dataclass
class Picky(Workflow):
    """Waits on a signal or a Touchy handler, then on a second signal."""

    id: str = ""
    marker: str = ""
    stage: int = 0

    def next_stage(self) -> None:
        self.stage += 1

    def definition(self) -> Section:
        return S(
            Wait("first", On("go", Signal()), On("touch", Touchy(self.marker))),
            Step("between", self.next_stage),
            Wait("second", On("go2", Signal())),
            Step("last", self.next_stage),
        )


@dataclass
class Hang(Workflow):
    """Runs one step that hangs on its first run: async (cancelled) or sync (abandoned)."""

    id: str = ""
    sync: bool = False
    hang_s: float = 3600.0
    timeout_s: float = 0.3
    runs: int = 0

    async def stuck(self) -> None:
        if first_time(self.id, "stuck"):
            record(self.id, "stuck", "fail")
            await anyio.sleep(self.hang_s)
        record(self.id, "stuck")
        self.runs += 1

    def slow(self) -> None:
        record(self.id, "slow")
        if first_time(self.id, "slow"):
            time.sleep(self.hang_s)
        self.runs += 1

    def definition(self) -> Section:
        if self.sync:
            return S(Step("slow", self.slow, timeout=self.timeout_s))
        return S(Step("stuck", self.stuck, timeout=self.timeout_s))
