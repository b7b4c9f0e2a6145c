"""Workflows the callback tests run inside a real workflowd: a counter, and a step after a signal."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from daemon import For, On, S, Section, Step, Wait, Workflow
from handlers import Signal


@dataclass
class BumpCounter(Workflow):
    """Counts "bump" signals forever; each one is a callback, then a wait for the next."""

    count: int = 0

    def bump(self, by: int = 1) -> int:
        self.count += by
        return self.count

    def definition(self) -> Section:
        return S(For("loop", True, Wait("wait", On("bump", Signal(self.bump)))))


@dataclass
class GateThenSlow(Workflow):
    """Takes a "go" signal, then runs a step that blocks until the file `release` exists."""

    release: str = ""
    got: int = 0
    done: bool = False

    def go(self, value: int) -> str:
        self.got = value
        return "going"

    def slow(self) -> None:
        deadline = time.monotonic() + 60  # a ceiling, so a failed test cannot hang the daemon
        while not Path(self.release).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.done = True

    def definition(self) -> Section:
        return S(Wait("gate", On("go", Signal(self.go))), Step("slow", self.slow))


@dataclass
class Toggle(Workflow):
    """Answers "poke" with a handler its data picks: its definition follows its data.

    In mode "a" the handler flips to "b" itself; in mode "b" it only asks, and the step after
    the wait flips back to "a".
    """

    mode: str = "a"
    asked: bool = False

    def flip(self, value: int | None = None) -> str:
        self.mode = "b"
        return "a->b"

    def ask(self, value: int | None = None) -> str:
        self.asked = True
        return "b asked"

    def settle(self) -> None:
        if self.asked:
            self.mode, self.asked = "a", False

    def definition(self) -> Section:
        handler = self.flip if self.mode == "a" else self.ask
        wait = Wait("wait", On("poke", Signal(handler)))
        return S(For("loop", True, S(wait, Step("settle", self.settle))))


@dataclass
class Echo(Workflow):
    """Answers each "echo" signal with its input, and counts them; the input is not kept."""

    echoed: int = 0

    def echo(self, text: str = "") -> str:
        self.echoed += 1
        return text

    def definition(self) -> Section:
        return S(For("loop", True, Wait("wait", On("echo", Signal(self.echo)))))
