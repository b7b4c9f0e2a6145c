"""Tests for the definition checks: busy loops, waits without timeout, dead code, duplicates."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from daemon import Break, For, Go, If, On, Return, S, Section, Step, Wait, WaitFor, Workflow
from daemon.core.lint import Finding, lint, lint_workflow
from daemon.runtime.runtime import log_findings
from tests.helpers.support import Recorder

SIGNAL = Recorder(type="signal")
TIMER = Recorder(type="timer")


def noop() -> None:
    """Do nothing (a step action)."""


def codes(findings: list[Finding]) -> list[tuple[str, str, str]]:
    """Return (level, code, statement) of each finding."""
    return [(f.level, f.code, f.statement) for f in findings]


class TestLint:
    """Each check fires on the problem it names, and only there."""

    def test_clean_definition(self) -> None:
        """A loop that blocks and a wait with a timeout give no finding."""
        root = S(
            For("loop", True, Wait("w", On("go", SIGNAL), On("late", TIMER, Break()))),
            Step("done", noop),
        )
        assert lint(root) == []

    def test_busy_loop(self) -> None:
        """A For whose body cannot block is a busy loop; a Go inside it does not count."""
        root = S(
            For("spin", True, If(True, "out", Break())),
            For("spawn", True, Go("child", S(Step("in_child", noop)))),
            For("nested", True, For("inner", True, Step("work", noop))),
        )
        assert codes(lint(root)) == [
            ("warning", "busy_loop", "spin"),
            ("warning", "busy_loop", "spawn"),
        ]

    def test_wait_without_timer(self) -> None:
        """A Wait with no Timer case may wait forever."""
        root = S(Wait("ask", On("yes", SIGNAL), On("no", SIGNAL)), WaitFor("c", True))
        found = lint(root)
        assert codes(found) == [("warning", "no_timeout", "ask")]
        assert "waits forever" in found[0].message

    def test_unreachable(self) -> None:
        """Statements after a Return or Break in the same block are reported once per block."""
        root = S(
            For(
                "loop",
                True,
                Wait("w", On("t", TIMER)),
                Break(),
                Step("dead", noop),
                Step("x", noop),
            ),
            Return(),
            Wait("never", On("t2", TIMER)),
        )
        assert codes(lint(root)) == [
            ("warning", "unreachable", "never"),
            ("warning", "unreachable", "dead"),
        ]

    def test_unreachable_unnamed(self) -> None:
        """An unnamed statement after a jump is named by its kind."""
        root = S(For("l", True, Wait("w", On("t", TIMER)), Break(), Break()))
        assert codes(lint(root)) == [("warning", "unreachable", "Break()")]

    def test_duplicates_are_errors(self) -> None:
        """Every duplicated name is an error, including a step reusing an event's name."""
        root = S(
            Step("a", noop),
            Step("a", noop),
            Wait("w", On("b", TIMER)),
            Step("b", noop),
        )
        found = lint(root)
        assert codes(found) == [("error", "duplicate_name", "a"), ("error", "duplicate_name", "b")]
        assert "Step, Step" in found[0].message
        assert "event, Step" in found[1].message

    def test_other_validation_errors(self) -> None:
        """A Break outside any For is an error."""
        assert codes(lint(S(Break()))) == [("error", "invalid", "")]

    def test_to_dict(self) -> None:
        """A finding is plain JSON-able data."""
        f = Finding("warning", "busy_loop", "x", "m")
        assert f.to_dict() == {
            "level": "warning",
            "code": "busy_loop",
            "statement": "x",
            "message": "m",
        }


@dataclass
class Spins(Workflow):
    """A workflow whose loop never blocks."""

    n: int = 0

    def definition(self) -> Section:
        return S(For("spin", self.n < 3, If(True, "bump", Break())))


@dataclass
class Required(Workflow):
    """A workflow with a field that has no default."""

    who: str

    def definition(self) -> Section:
        return S()


@dataclass
class Broken(Workflow):
    """A workflow whose definition raises."""

    def definition(self) -> Section:
        raise KeyError("oops")


class TestLintWorkflow:
    """Workflow types are checked from their fields' defaults."""

    def test_workflow(self) -> None:
        """A workflow type's definition is built and checked."""
        assert codes(lint_workflow(Spins)) == [("warning", "busy_loop", "spin")]

    def test_no_defaults(self) -> None:
        """A type that cannot be built from defaults is reported, not checked."""
        assert codes(lint_workflow(Required)) == [("warning", "not_checked", "")]

    def test_definition_raises(self) -> None:
        """A definition() that raises is an error."""
        found = lint_workflow(Broken)
        assert codes(found) == [("error", "definition_failed", "")]
        assert "KeyError" in found[0].message

    def test_log_findings(self) -> None:
        """Findings are logged with the workflow type, errors as errors."""
        with structlog.testing.capture_logs() as logs:
            assert log_findings({"Spins": Spins, "Broken": Broken}) == 2
        assert [(r["event"], r["workflow"], r["code"]) for r in logs] == [
            ("lint_error", "Broken", "definition_failed"),
            ("lint_warning", "Spins", "busy_loop"),
        ]
