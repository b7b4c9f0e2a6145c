"""Versions of one workflow module, written into a test's folder and swapped before a reload.

`V1` is what the daemon starts with. `V2` is a compatible upgrade: step bodies change (through
the module constant SUFFIX) and steps are added after the current ones. `V3` is incompatible:
it renames the Wait that a waiting thread stands at and removes a running Go. `BROKEN` does not
import. Each version marks what it ran with its SUFFIX, so a test can tell old code from new.
"""

from __future__ import annotations

from pathlib import Path

_HEAD = """
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from daemon import Go, On, S, Section, Step, Wait, Workflow
from handlers import Signal

SUFFIX = "{suffix}"


@dataclass
class Busy(Workflow):
    flag: str = ""
    done: list[str] = field(default_factory=list)

    def hold(self) -> None:
        # Runs while the test reloads; ends once the test creates the flag file.
        deadline = time.monotonic() + 20
        while not os.path.exists(self.flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.done.append("hold-" + SUFFIX)
"""

V1 = (
    _HEAD
    + """
    def definition(self) -> Section:
        return S(Step("hold", self.hold))


@dataclass
class Gate(Workflow):
    done: list[str] = field(default_factory=list)

    def definition(self) -> Section:
        return S(
            Go("side", S(Wait("side_wait", On("poke", Signal())))),
            Wait("gate", On("go", Signal())),
            Step("after", lambda: self.done.append("after-" + SUFFIX)),
        )
"""
)

V2 = (
    _HEAD
    + """
    def definition(self) -> Section:
        return S(
            Step("hold", self.hold),
            Step("more", lambda: self.done.append("more-" + SUFFIX)),
        )


@dataclass
class Gate(Workflow):
    done: list[str] = field(default_factory=list)
    extra: int = 0

    def definition(self) -> Section:
        return S(
            Go("side", S(Wait("side_wait", On("poke", Signal())))),
            Wait("gate", On("go", Signal())),
            Step("after", lambda: self.done.append("after-" + SUFFIX)),
            Step("extra", lambda: self.done.append("extra-" + SUFFIX)),
        )
"""
)

V3 = (
    _HEAD
    + """
    def definition(self) -> Section:
        return S(Step("hold", self.hold))


@dataclass
class Gate(Workflow):
    done: list[str] = field(default_factory=list)

    def definition(self) -> Section:
        return S(
            Wait("gate_renamed", On("go", Signal())),
            Step("after", lambda: self.done.append("after-" + SUFFIX)),
        )
"""
)

BROKEN = "def definition(:\n"


def write(folder: Path, module: str, source: str, suffix: str = "") -> Path:
    """Write one version of the module as `folder/module.py` and return its path."""
    path = folder / f"{module}.py"
    path.write_text(source.replace("{suffix}", suffix))
    return path
