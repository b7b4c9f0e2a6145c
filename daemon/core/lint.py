"""Definition checks: find statements that will misbehave before a workflow runs into them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from daemon.core.statements import (
    Break,
    Continue,
    Definition,
    For,
    Go,
    Return,
    Section,
    Step,
    Stmt,
    Wait,
    WaitFor,
    _Branching,
    children,
    walk,
)
from daemon.core.workflow import Workflow
from daemon.errors import WorkflowError

log = structlog.get_logger()

#: The handler type of handlers.Timer (the daemon package does not import handlers).
TIMER_TYPE = "timer"
_BLOCKING = (Step, Wait, WaitFor)
_JUMPS = (Return, Break, Continue)


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem of a definition: an error (it cannot run) or a warning (it may misbehave)."""

    level: str
    code: str
    statement: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        """Return the finding as JSON-able data."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


def _names(stmt: Stmt) -> Iterator[tuple[str, str]]:
    """Yield (name, kind) for every named statement and Wait case."""
    for s in walk(stmt):
        match s:
            case Step() | For() | Wait() | WaitFor() | Go():
                yield s.name, type(s).__name__
                if isinstance(s, Wait):
                    yield from ((c.event, "event") for c in s.cases)
            case _Branching(branches=branches):
                yield from ((b.name, "branch") for b in branches)


def _blocks(stmt: Stmt) -> bool:
    """Tell whether running `stmt` can stop its thread (a Go body runs in another thread)."""
    if isinstance(stmt, _BLOCKING):
        return True
    return any(_blocks(c) for c in children(stmt) if not isinstance(c, Go))


def _label(stmt: Stmt) -> str:
    name = getattr(stmt, "name", None)
    return name if isinstance(name, str) else f"{type(stmt).__name__}()"


def lint(root: Section) -> list[Finding]:
    """Return every problem found in a definition tree, errors first."""
    invalid: Finding | None = None
    try:
        Definition(root)
    except WorkflowError as e:
        invalid = Finding("error", "invalid", "", str(e))
    try:
        duplicates = _duplicates(root)
        warnings = _warnings(root)
    except Exception:
        if invalid is None:
            raise
        return [invalid]
    # Validation stops at the first duplicate, which is reported above with the others.
    errors = duplicates or ([invalid] if invalid else [])
    return errors + warnings


def _duplicates(root: Section) -> list[Finding]:
    kinds: dict[str, list[str]] = {}
    for name, kind in _names(root):
        kinds.setdefault(name, []).append(kind)
    found = []
    for name, seen in kinds.items():
        if len(seen) > 1:
            message = (
                f"{name!r} names {len(seen)} statements ({', '.join(seen)}); names must be unique"
            )
            found.append(Finding("error", "duplicate_name", name, message))
    return found


def _warnings(root: Section) -> list[Finding]:
    found = []
    for s in walk(root):
        if isinstance(s, For) and not _blocks(s.body):
            message = (
                f"for {s.name!r}: its body has no Step, Wait or WaitFor, so it loops without "
                "blocking until its condition turns false (or the runaway limit fails it)"
            )
            found.append(Finding("warning", "busy_loop", s.name, message))
        if isinstance(s, Wait) and not any(c.handler.type == TIMER_TYPE for c in s.cases):
            message = f"wait {s.name!r} has no Timer case: it waits forever if no event comes"
            found.append(Finding("warning", "no_timeout", s.name, message))
        if isinstance(s, Section):
            for i, stmt in enumerate(s.stmts[:-1]):
                if isinstance(stmt, _JUMPS):
                    after = _label(s.stmts[i + 1])
                    message = (
                        f"{after} and what follows it can never run: they come after "
                        f"{type(stmt).__name__}() in the same block"
                    )
                    found.append(Finding("warning", "unreachable", after, message))
                    break
    return found


def lint_workflow(cls: type[Workflow]) -> list[Finding]:
    """Check the definition of a workflow type, built from its fields' defaults."""
    try:
        wf = cls.from_input(None)
    except WorkflowError as e:
        message = f"cannot build a {cls.name} from its field defaults to check it: {e}"
        return [Finding("warning", "not_checked", "", message)]
    try:
        root = wf.definition()
    except Exception as e:  # noqa: BLE001 - user code: any failure is the finding
        message = f"definition() raised {type(e).__name__}: {e}"
        return [Finding("error", "definition_failed", "", message)]
    return lint(root)


def log_findings(registry: dict[str, type[Workflow]]) -> int:
    """Log the findings of every registered workflow type (at start); return how many."""
    count = 0
    for name, cls in sorted(registry.items()):
        try:
            findings = lint_workflow(cls)
        except Exception as e:  # noqa: BLE001 - checking must never stop the daemon
            findings = [Finding("error", "invalid", "", f"{type(e).__name__}: {e}")]
        for f in findings:
            count += 1
            emit = log.error if f.level == "error" else log.warning
            emit(
                f"lint_{f.level}", workflow=name, code=f.code, statement=f.statement, note=f.message
            )
    return count
