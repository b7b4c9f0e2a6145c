"""Workflows the PostgreSQL e2e tests (tests/e2e/test_postgres.py) run on several daemons."""

from __future__ import annotations

from dataclasses import dataclass

from daemon import On, S, Section, Step, Wait, Workflow
from handlers import FileWatch, Timer
from tests.workflows.e2e import record


@dataclass
class Snooze(Workflow):
    """Sleeps `delay_s` on a timer, then runs one recorded step (a second run is a re-run)."""

    id: str = ""
    delay_s: float = 1.0
    runs: int = 0

    def work(self) -> None:
        record(self.id, "work", self.runs)
        self.runs += 1

    def definition(self) -> Section:
        return S(Wait("nap", On("wake", Timer(after=self.delay_s))), Step("work", self.work))


@dataclass
class Parcel(Workflow):
    """Waits for a file to be created (a node-local wait), then runs one recorded step."""

    id: str = ""
    path: str = ""
    runs: int = 0

    def work(self) -> None:
        record(self.id, "work", self.runs)
        self.runs += 1

    def definition(self) -> Section:
        return S(Wait("drop", On("arrived", FileWatch(self.path))), Step("work", self.work))
