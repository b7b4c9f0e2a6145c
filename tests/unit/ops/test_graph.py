"""Tests for the definition diagrams: shapes, control flow, and where a live workflow is."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from daemon import (
    Break,
    Continue,
    For,
    Go,
    If,
    On,
    Return,
    S,
    Section,
    Step,
    Wait,
    WaitFor,
    Workflow,
    definition_to_dict,
)
from daemon.core.state import EventStatus, WorkflowStatus
from daemon.ops.graph import render
from tests.helpers.support import Driver, Recorder

SIGNAL = Recorder(type="signal")
TIMER = Recorder(type="timer")


def noop() -> None:
    """Do nothing (a step action)."""


def tree() -> Section:
    """Build a definition with a loop, a branch, a wait and a parallel thread."""
    return S(
        Step("fetch", noop),
        Go("ticker", S(Wait("tick_wait", On("tick", TIMER)), Step("tock", noop))),
        For(
            "loop",
            True,
            Wait("gate", On("add", SIGNAL, Step("count", noop)), On("late", TIMER, Break())),
            If(False, "small", Continue()).else_("big", Return()),
        ),
        WaitFor("ready", True),
    )


def edges(text: str) -> set[tuple[str, str, str]]:
    """Return the Mermaid edges as (source label, target label, edge label)."""
    labels = dict(re.findall(r"^\s+(n\d+)\W+\"([^\"]*)\"", text, re.MULTILINE))
    out = set()
    for src, label, dst in re.findall(
        r"^\s+(n\d+) -\.?->(?:\|([^|]*)\|)? (n\d+)$", text, re.MULTILINE
    ):
        out.add((labels[src].split("<br/>")[0], labels[dst].split("<br/>")[0], label))
    return out


@dataclass
class Pair(Workflow):
    """Waits for a signal while a second thread waits for a timer."""

    got: list[str] = field(default_factory=list)

    def definition(self) -> Section:
        return S(
            Go("side", S(Wait("nap", On("wake", TIMER)))),
            Wait("ask", On("answer", SIGNAL, Step("use", noop))),
        )


class TestShape:
    """The diagram follows the control flow of the definition."""

    def test_control_flow_edges(self) -> None:
        """Sequence, loop back edges, break, continue, return and a thread start are drawn."""
        got = edges(render(definition_to_dict(tree())))
        assert {
            ("start", "fetch", ""),
            ("fetch", "go ticker", ""),
            ("go ticker", "wait tick_wait", "starts"),
            ("tock", "end ticker", ""),
            ("for loop", "wait gate", "loop"),
            ("wait gate", "add · signal", ""),
            ("add · signal", "count", ""),
            ("small", "for loop", ""),  # Continue
            ("late · timer", "wait_for ready", ""),  # Break
            ("big (default)", "end", ""),  # Return
            ("for loop", "wait_for ready", "done"),
            ("wait_for ready", "end", ""),
        } <= got

    def test_if_without_default_can_fall_through(self) -> None:
        """An If with no else branch has a `none` edge past it."""
        got = edges(
            render(definition_to_dict(S(If(False, "only", Step("a", noop)), Step("b", noop))))
        )
        assert ("if", "b", "none") in got
        assert ("a", "b", "") in got

    def test_go_thread_is_a_subgraph(self) -> None:
        """A Go body is drawn in its own subgraph, in both formats."""
        assert 'subgraph t1["thread ticker"]' in render(definition_to_dict(tree()))
        dot = render(definition_to_dict(tree()), "dot", title="Demo")
        assert 'label="thread ticker"' in dot
        assert 'label="Demo"; labelloc=t;' in dot

    def test_dot_is_well_formed(self) -> None:
        """Every dot edge joins declared nodes and quotes in names are escaped."""
        dot = render(definition_to_dict(S(Step('say "hi"', noop))), "dot")
        assert 'label="say \\"hi\\""' in dot
        declared = set(re.findall(r"^\s+(n\d+) \[", dot, re.MULTILINE))
        for src, dst in re.findall(r"^\s+(n\d+) -> (n\d+)", dot, re.MULTILINE):
            assert {src, dst} <= declared

    def test_unknown_format(self) -> None:
        """An unknown format is refused."""
        with pytest.raises(ValueError, match="unknown graph format"):
            render(definition_to_dict(tree()), "png")


class TestOverlay:
    """With a state, the diagram shows where each thread is and which waits are armed."""

    async def test_threads_and_armed_waits(self) -> None:
        """Each waiting thread points at its Wait; set-up cases are marked armed."""
        d = Driver(Pair())
        await d.resume()
        text = render(definition_to_dict(d.wf.definition()), state=d.state)
        assert ("_main_: WaitingEvent", "wait ask", "") in edges(text)
        assert ("side: WaitingEvent", "wait nap", "") in edges(text)
        assert "answer · signal<br/>[Setup]" in text
        ids = {label: nid for nid, label in re.findall(r"(n\d+)\W+\"([^\"]*)\"", text)}
        armed = re.search(r"class ([\w,]+) armed", text)
        assert armed is not None
        assert set(armed.group(1).split(",")) == {
            ids["answer · signal<br/>[Setup]"],
            ids["wake · timer<br/>[Setup]"],
        }
        here = re.search(r"class ([\w,]+) here", text)
        assert here is not None and set(here.group(1).split(",")) == {
            ids["wait ask"],
            ids["wait nap"],
        }

    async def test_failed_and_missing_statement(self) -> None:
        """A failed workflow's position is marked failed; a vanished statement is named."""
        d = Driver(Pair())
        await d.resume()
        d.state.status = WorkflowStatus.FAILED
        d.state.threads[0].cur_step = "gone"
        d.state.threads[1].wait_events[0].status = EventStatus.SETUP_ERROR
        d.state.threads[1].wait_events[0].error = "boom"
        text = render(definition_to_dict(d.wf.definition()), "dot", state=d.state)
        assert "at 'gone' (not in the definition)" in text
        assert "wake · timer\\n[SetupError] boom" in text
        assert re.search(r'label="wait nap", shape=parallelogram, fillcolor="#fecaca"', text)

    async def test_finished_marks_the_end(self) -> None:
        """A finished workflow's main thread is at the end node."""
        d = Driver(Pair())
        await d.resume()
        await d.send("answer", "yes")
        assert d.state.status is WorkflowStatus.FINISHED
        text = render(definition_to_dict(d.wf.definition()), state=d.state)
        assert ("Finished", "end", "") in edges(text)
