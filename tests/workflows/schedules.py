"""Workflows and schedules the schedule tests run inside a real daemon.

The schedules come from $WORKFLOWD_TEST_SCHEDULES, a JSON list of `Schedule` keyword
arguments, so each test daemon gets exactly the schedules it needs; each becomes a
module-level `Schedule` object, as in an operator's module.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import anyio

from daemon import On, S, Schedule, Section, Step, Wait, Workflow
from handlers import Signal, Timer

#: The variable a test sets to the schedules it wants.
SCHEDULES_ENV = "WORKFLOWD_TEST_SCHEDULES"


@dataclass
class Chime(Workflow):
    """Rings once and finishes: a scheduled workflow that never overlaps the next one."""

    label: str = ""
    rang: bool = False

    def ring(self) -> None:
        self.rang = True

    def definition(self) -> Section:
        return S(Step("ring", self.ring))


@dataclass
class Lingers(Workflow):
    """Waits for `finish` (or `linger_s`): a scheduled run that is still going at the next fire."""

    linger_s: float = 3600.0
    finished_by: str = ""

    def finish(self, by: str = "") -> str:
        self.finished_by = by or "signal"
        return "finishing"

    def definition(self) -> Section:
        return S(
            Wait(
                "linger",
                On("finish", Signal(self.finish)),
                On("linger_over", Timer(after=self.linger_s)),
            )
        )


@dataclass
class Dozes(Workflow):
    """Its one step waits until the file `flag` exists: a fired run that stays in its step."""

    flag: str = ""
    woke: bool = False

    async def doze(self) -> None:
        # The flag comes from another process (the test): no event to wait on, only the file.
        while not await anyio.Path(self.flag).exists():  # noqa: ASYNC110 - see above
            await anyio.sleep(0.05)
        self.woke = True

    def definition(self) -> Section:
        return S(Step("doze", self.doze))


def _from_env() -> dict[str, Schedule]:
    specs = json.loads(os.environ.get(SCHEDULES_ENV) or "[]")
    return {f"schedule_{i}": Schedule(**spec) for i, spec in enumerate(specs)}


globals().update(_from_env())
