"""Definition checks: find statements that will misbehave before a workflow runs into them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from daemon.core.definition import Definition, named
from daemon.core.statements import (
    Break,
    Continue,
    For,
    Go,
    Return,
    Section,
    Step,
    Stmt,
    Wait,
    WaitFor,
    children,
    walk,
)
from daemon.core.workflow import Workflow
from daemon.errors import WorkflowdError

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
    except WorkflowdError as e:
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
    for n in named(root):
        # Statements by their class (as the author wrote them), cases and branches by kind.
        label = n.kind if n.kind in ("event", "branch") else type(n.node).__name__
        kinds.setdefault(n.name, []).append(label)
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
    except WorkflowdError as e:
        message = f"cannot build a {cls.name} from its field defaults to check it: {e}"
        return [Finding("warning", "not_checked", "", message)]
    try:
        root = wf.definition()
    except Exception as e:  # noqa: BLE001 - user code: any failure is the finding
        message = f"definition() raised {type(e).__name__}: {e}"
        return [Finding("error", "definition_failed", "", message)]
    return lint(root)
