"""Tests for the statement DSL: building, walking, finding, indexing and describing definitions."""

from __future__ import annotations

import dataclasses
import re

import pytest

from daemon import (
    Break,
    Case,
    Continue,
    Default,
    For,
    Go,
    If,
    On,
    Retry,
    Return,
    S,
    Section,
    Step,
    Stmt,
    Switch,
    UnknownStatement,
    ValidationError,
    Wait,
    WaitFor,
    definition_to_dict,
    find_handler,
    find_step,
    validate,
    walk,
)
from daemon.core.definition import Definition
from daemon.core.statements import truth
from tests.helpers.support import Recorder

REC = Recorder()
TIMER = Recorder(type="timer")


def noop() -> None:
    """Do nothing (a step action)."""


def sample() -> Section:
    """Build a definition that uses every statement kind once."""
    return S(
        Step("first", noop),
        If(True, "if_a", Step("in_a", noop))
        .elif_(False, "if_b", Step("in_b", noop), Return())
        .else_("if_c", Step("in_c", noop)),
        Switch(
            Case(False, "case_x", Step("in_x", noop)),
            Default("case_dflt", Step("in_dflt", noop)),
        ),
        For(
            "loop",
            True,
            Step("body", noop),
            If(False, "skip", Continue()),
            If(True, "stop", Break()),
        ),
        Wait(
            "pick",
            On("approve", REC, Step("approved", noop)),
            On("timeout", TIMER),
        ),
        WaitFor("until", True, noop),
        Go("worker", S(Step("work", noop), Wait("worker_wait", On("poke", REC)))),
        Return(),
    )


def names(stmts: list[Stmt]) -> list[str]:
    """Name each statement: its `name`, or its class for unnamed ones."""
    return [getattr(s, "name", type(s).__name__) for s in stmts]


class TestBuild:
    """Statements keep what they are built from."""

    def test_if_chain_returns_same_statement(self) -> None:
        """elif_ and else_ add branches to the same If, in order; else is the default."""
        stmt = If(1, "a").elif_(0, "b").else_("c")
        assert [b.name for b in stmt.branches] == ["a", "b", "c"]
        assert [b.default for b in stmt.branches] == [False, False, True]

    def test_go_wraps_single_statement_and_derives_thread_id(self) -> None:
        """A single-statement Go body becomes a Section; the thread id includes the id."""
        step = Step("s", noop)
        go = Go("g", step)
        assert isinstance(go.body, Section) and go.body.stmts == (step,)
        assert go.thread_id == "g"
        assert Go("g", S(), id="7").thread_id == "g:7"

    @pytest.mark.parametrize(
        ("cond", "want"),
        [(True, True), (0, False), ("x", True), (lambda: 1, True), (lambda: None, False)],
    )
    def test_truth(self, cond: object, want: bool) -> None:
        """A condition is a plain value or a zero-argument callable."""
        assert truth(cond) is want


class TestWalk:
    """walk visits every statement depth first, in definition order."""

    def test_order(self) -> None:
        """Parents come before children; siblings keep their order; Go bodies are included."""
        kinds = [
            "Section", "first", "If", "Section", "in_a", "Section", "in_b", "Return",
            "Section", "in_c", "Switch", "Section", "in_x", "Section", "in_dflt",
            "loop", "Section", "body", "If", "Section", "Continue", "If", "Section", "Break",
            "pick", "Section", "approved", "Section", "until",
            "worker", "Section", "work", "worker_wait", "Section", "Return",
        ]  # fmt: skip
        assert names(list(walk(sample()))) == kinds

    def test_single_statement(self) -> None:
        """Walking a leaf yields just the leaf."""
        step = Step("only", noop)
        assert list(walk(step)) == [step]


class TestFind:
    """find_step and find_handler search the whole tree."""

    @pytest.mark.parametrize("name", ["first", "in_b", "in_dflt", "body", "approved", "work"])
    def test_find_step_anywhere(self, name: str) -> None:
        """Steps inside branches, loops, wait cases and Go bodies are found."""
        step = find_step(sample(), name)
        assert isinstance(step, Step) and step.name == name

    @pytest.mark.parametrize("name", ["missing", "loop", "pick", "until", "if_a", "approve"])
    def test_find_step_misses(self, name: str) -> None:
        """Names of absent or non-Step statements give None."""
        assert find_step(sample(), name) is None

    @pytest.mark.parametrize(
        ("event", "handler"), [("approve", REC), ("timeout", TIMER), ("poke", REC)]
    )
    def test_find_handler(self, event: str, handler: Recorder) -> None:
        """The handler of a Wait case is found by its event name, in Go bodies too."""
        assert find_handler(sample(), event) is handler

    @pytest.mark.parametrize("event", ["nope", "pick", "first"])
    def test_find_handler_misses(self, event: str) -> None:
        """Names that are not events give None."""
        assert find_handler(sample(), event) is None


class TestDefinitionToDict:
    """definition_to_dict describes every statement kind as plain data."""

    def test_every_kind(self) -> None:
        """The whole sample tree is described with names, branches, cases and handler types."""
        step = {"type": "step", "name": "{}"}

        def s(name: str) -> dict[str, str]:
            return {k: v.format(name) for k, v in step.items()}

        assert definition_to_dict(sample()) == {
            "type": "section",
            "children": [
                s("first"),
                {
                    "type": "if",
                    "branches": [
                        {"name": "if_a", "default": False, "children": [s("in_a")]},
                        {
                            "name": "if_b",
                            "default": False,
                            "children": [s("in_b"), {"type": "return"}],
                        },
                        {"name": "if_c", "default": True, "children": [s("in_c")]},
                    ],
                },
                {
                    "type": "switch",
                    "branches": [
                        {"name": "case_x", "default": False, "children": [s("in_x")]},
                        {"name": "case_dflt", "default": True, "children": [s("in_dflt")]},
                    ],
                },
                {
                    "type": "for",
                    "name": "loop",
                    "children": [
                        s("body"),
                        {
                            "type": "if",
                            "branches": [
                                {
                                    "name": "skip",
                                    "default": False,
                                    "children": [{"type": "continue"}],
                                }
                            ],
                        },
                        {
                            "type": "if",
                            "branches": [
                                {"name": "stop", "default": False, "children": [{"type": "break"}]}
                            ],
                        },
                    ],
                },
                {
                    "type": "wait",
                    "name": "pick",
                    "cases": [
                        {"event": "approve", "handler": "recorder", "children": [s("approved")]},
                        {"event": "timeout", "handler": "timer", "children": []},
                    ],
                },
                {"type": "wait_for", "name": "until"},
                {
                    "type": "go",
                    "name": "worker",
                    "children": [
                        s("work"),
                        {
                            "type": "wait",
                            "name": "worker_wait",
                            "cases": [{"event": "poke", "handler": "recorder", "children": []}],
                        },
                    ],
                },
                {"type": "return"},
            ],
        }

    def test_unknown_statement_named_by_class(self) -> None:
        """A Stmt subclass the DSL does not know is described by its class name."""

        class Custom(Stmt):
            __slots__ = ()

        assert definition_to_dict(S(Custom())) == {
            "type": "section",
            "children": [{"type": "Custom"}],
        }

    def test_plain_data(self) -> None:
        """The description holds no callables or handler objects."""

        def leaves(x: object) -> list[object]:
            if isinstance(x, dict):
                return [v for val in x.values() for v in leaves(val)]
            if isinstance(x, list):
                return [v for val in x for v in leaves(val)]
            return [x]

        assert all(isinstance(v, str | bool) for v in leaves(definition_to_dict(sample())))


class TestDefinition:
    """Definition indexes a tree by name and rejects malformed ones."""

    def test_index(self) -> None:
        """Steps, waits, wait_fors, Go statements and events are indexed by name, Go bodies too."""
        d = Definition(sample())
        assert set(d.steps) == {
            "first", "in_a", "in_b", "in_c", "in_x", "in_dflt", "body", "approved", "work"
        }  # fmt: skip
        assert set(d.waits) == {"pick", "worker_wait"}
        assert set(d.wait_fors) == {"until"}
        assert set(d.gos) == {"worker"}
        assert set(d.events) == {"approve", "timeout", "poke"}
        assert d.events["timeout"].handler is TIMER

    def test_subclass_of_a_statement_is_indexed(self) -> None:
        """A subclass of a known statement is treated as that statement."""

        class Logged(Step):
            __slots__ = ()

        assert isinstance(Definition(S(Logged("x", noop))).steps["x"], Logged)

    @pytest.mark.parametrize("bad", ["text", 3, None, Section])
    def test_not_a_statement(self, bad: object) -> None:
        """An object that is not a statement is rejected, naming it."""
        with pytest.raises(UnknownStatement, match=re.escape(repr(bad))):
            validate(S(Step("ok", noop), bad))  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("section", "message"),
        [
            (S(For("l", True, Go("g", S(Break())))), "Break\\(\\) outside a For"),
            (S(If(True, "i", Continue())), "Continue\\(\\) outside a For"),
            (S(Go("g", S(Step("s", noop))), Step("s", noop)), "duplicate name 's' \\(step\\)"),
            (S(If(True, "x").else_("x")), "duplicate name 'x' \\(branch\\)"),
            (S(Wait("w", On("e", REC)), WaitFor("e", True)), "duplicate name 'e' \\(wait_for\\)"),
            (S(Wait("w", "e")), "cases must be On"),  # type: ignore[arg-type]
            (S(For(5, True)), "for needs a non-empty string name"),  # type: ignore[arg-type]
        ],
    )
    def test_rejects(self, section: Section, message: str) -> None:
        """Malformed trees fail with a message saying what is wrong."""
        with pytest.raises(ValidationError, match=message):
            Definition(section)

    def test_return_anywhere(self) -> None:
        """Return is allowed outside a For, in Go bodies and branches."""
        validate(S(Return(), Go("g", S(Return())), If(True, "i", Return())))


class TestRetry:
    """Retry's fields default to the daemon's configuration."""

    def test_defaults(self) -> None:
        """Every field is None (use the config) and nothing is non-retryable."""
        r = Retry()
        assert (r.initial_s, r.max_s, r.max_attempts, r.non_retryable) == (None, None, None, ())

    def test_frozen(self) -> None:
        """A Retry cannot be changed after it is built."""
        with pytest.raises(dataclasses.FrozenInstanceError):
            Retry().max_attempts = 3  # type: ignore[misc]

    def test_step_carries_retry_and_timeout(self) -> None:
        """A Step keeps its retry policy and timeout; both default to None."""
        r = Retry(initial_s=0.5, max_attempts=3, non_retryable=(KeyError,))
        assert Step("s", noop, retry=r, timeout=2.0).retry is r
        plain = Step("s", noop)
        assert (plain.retry, plain.timeout) == (None, None)
