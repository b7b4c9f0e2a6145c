"""Workflows the handler end-to-end tests run, in process and inside a real workflowd."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio

from daemon import For, Handler, On, S, Section, Step, Wait, Workflow
from handlers import FileWatch, Signal, SocketListen, Timer


def keeping(handler: Handler, into: dict[str, Any]) -> Handler:
    """Make `handler` also store its output under `into["got"]`, so the data shows the input."""
    inner = handler.handle

    async def handle(req: Any, input: Any) -> Any:
        out = await inner(req, input)
        into["got"] = out
        return out

    handler.handle = handle  # type: ignore[method-assign] # a per-instance wrapper, nothing more
    return handler


@dataclass
class Guarded(Workflow):
    """Waits for one handler under test (`it`) or a `stop` signal, and records which case ran.

    `kind` picks the handler: timer (`after` or `at`), file (`path`, `on`), socket
    (`path` or `port`) or signal; `stop_delay` makes the stop handler slow. Each case
    appends its name to `ran`, so exactly one entry means exactly one case won;
    `seen["got"]` is the input the handler delivered.
    """

    kind: str = "signal"
    after: float | None = None
    at: float | None = None
    path: str = ""
    on: str = "created"
    port: int | None = None
    stop_delay: float = 0.0
    ran: list[str] = field(default_factory=list)
    seen: dict[str, Any] = field(default_factory=dict)

    def handler(self) -> Handler:
        match self.kind:
            case "timer":
                return Timer(after=self.after, at=self.at)
            case "file":
                return FileWatch(self.path, on=self.on)
            case "socket":
                return SocketListen(path=self.path or None, port=self.port)
            case _:
                return Signal(lambda input: {"echo": input})

    async def stop(self, reason: str) -> str:
        if self.stop_delay:
            await anyio.sleep(self.stop_delay)  # lets the other case's event arrive meanwhile
        self.seen["stop"] = reason
        return f"stopped: {reason}"

    def definition(self) -> Section:
        return S(
            Wait(
                "w",
                On("it", keeping(self.handler(), self.seen), Step("it_ran", self.mark("it"))),
                On("stop", Signal(self.stop), Step("stop_ran", self.mark("stop"))),
            )
        )

    def mark(self, name: str) -> Any:
        return lambda: self.ran.append(name)


@dataclass
class Race(Workflow):
    """Runs `rounds` Waits in a loop, each a short Timer (or, with `path`, a SocketListen)
    against a `poke` Signal.

    Each case's step records `"<round>:<case>"` in `winners` and moves to the
    next round, so a round with two entries (or none) means both cases (or
    neither) ran.
    """

    rounds: int = 200
    after: float = 0.005
    path: str = ""
    round: int = 0
    winners: list[str] = field(default_factory=list)

    def poke(self, input: Any) -> int:
        return self.round

    def won(self, case: str) -> Any:
        def step() -> None:
            self.winners.append(f"{self.round}:{case}")
            self.round += 1

        return step

    def ticker(self) -> Handler:
        return SocketListen(path=self.path) if self.path else Timer(after=self.after)

    def definition(self) -> Section:
        return S(
            For(
                "rounds",
                self.round < self.rounds,
                Wait(
                    "race",
                    On("tick", self.ticker(), Step("by_tick", self.won(self.ticker().type))),
                    On("poke", Signal(self.poke), Step("by_signal", self.won("signal"))),
                ),
            )
        )
