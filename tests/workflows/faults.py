"""Workflows the fault tests run inside a real daemon: a broken wait beside healthy ones, a gate.

`Jammed` waits on a case whose setup always fails next to a Signal and a Timer, so a test can
check that the healthy cases work while the broken one is retried. `Gated` applies signals in a
loop, and one that asks for it first waits in its handler until a gate file exists, so a test
can fail the checkpoint that applies a particular event (lock the database, fill the disk) at a
moment of its choosing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from daemon import CallbackRequest, For, Handler, On, S, Section, Step, Wait, Workflow
from handlers import Signal, SocketListen, Timer


class NeverReady:
    """A handler whose setup always raises."""

    type = "never_ready"

    async def setup(self, req: CallbackRequest) -> str:
        """Refuse, every time."""
        raise RuntimeError("this handler never sets up")

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Return the input (never reached: the wait is never armed)."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Release nothing: setup armed nothing."""


@dataclass
class Jammed(Workflow):
    """Waits, round after round, on a broken case (`door`), a `poke` signal and a `wake` timer.

    `broken` picks the broken case: "socket" (a SocketListen at `path`, whose folder does not
    exist) or "raise" (NeverReady). Each poke appends its input to `pokes`, replies with how
    many came and starts a new round; the timer (`after_s` after its round began) ends the
    workflow, noting when it fired in `woke_at` (epoch seconds).
    """

    broken: str = "socket"
    path: str = ""
    after_s: float = 3600.0
    pokes: list[Any] = field(default_factory=list)
    woke_at: float = 0.0

    def door(self) -> Handler:
        return SocketListen(path=self.path) if self.broken == "socket" else NeverReady()

    def poke(self, value: Any) -> int:
        self.pokes.append(value)
        return len(self.pokes)

    def wake(self) -> None:
        self.woke_at = time.time()

    def definition(self) -> Section:
        return S(
            For(
                "rounds",
                not self.woke_at,
                Wait(
                    "w",
                    On("door", self.door()),
                    On("poke", Signal(self.poke)),
                    On("wake", Timer(after=self.after_s), Step("woke", self.wake)),
                ),
            )
        )


@dataclass
class Gated(Workflow):
    """Appends each `add` signal's `n` to `got` until `close`; a held `add` waits for a gate.

    An input `{"n": .., "hold": true}` touches `gate`.waiting, then does not return until the
    file `gate` exists: the event is then taken by the workflow but not yet saved.
    """

    gate: str = ""
    got: list[int] = field(default_factory=list)
    closed: bool = False

    async def add(self, input: dict[str, Any]) -> int:
        if input.get("hold"):
            await anyio.Path(f"{self.gate}.waiting").touch()
            while not await anyio.Path(self.gate).exists():  # noqa: ASYNC110 - a file, no event
                await anyio.sleep(0.02)
        self.got.append(int(input["n"]))
        return len(self.got)

    def close(self) -> None:
        self.closed = True

    def definition(self) -> Section:
        return S(
            For(
                "adds",
                not self.closed,
                Wait("next", On("add", Signal(self.add)), On("close", Signal(self.close))),
            )
        )
