"""Workflows whose steps log a value the log cannot turn into text (its __str__ raises)."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from daemon import S, Section, Step, Workflow

log = structlog.get_logger(__name__)


class Unprintable:
    """A value neither msgspec nor str() can render: workflow code may log anything."""

    def __str__(self) -> str:
        raise RuntimeError("this value has no text")

    __repr__ = __str__


@dataclass
class OddLogAsync(Workflow):
    """Logs an unprintable value from an async step (queued on the loop), then a plain one."""

    id: str = ""

    async def odd(self) -> None:
        log.info("odd_value", value=Unprintable(), note="async")

    async def after(self) -> None:
        log.info("after_odd", note="async")

    def definition(self) -> Section:
        return S(Step("odd", self.odd), Step("after", self.after))


@dataclass
class OddLogSync(Workflow):
    """Logs an unprintable value from a sync step (a worker thread: written at once)."""

    id: str = ""

    def odd(self) -> None:
        log.info("odd_value", value=Unprintable(), note="sync")

    def definition(self) -> Section:
        return S(Step("odd", self.odd))
