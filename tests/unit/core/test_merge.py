"""The per-field merge of overlapping steps' changes (daemon.core.merge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import S, Section, Step, Workflow
from daemon.core.merge import Fork, apply, fork, merge
from daemon.errors import HandlerRejected, StepNotFound

STEPS = 6


@dataclass
class Bag(Workflow):
    """Data every kind of field the merge tells apart: a list, a dict and scalars."""

    items: list[int] = field(default_factory=list)
    own: dict[str, int] = field(default_factory=dict)
    last: int = -1
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def definition(self) -> Section:
        return S(*[Step(f"s{i}", lambda: None) for i in range(STEPS)])


class TestMerge:
    """One field at a time."""

    def test_unchanged_keeps_the_live_value(self) -> None:
        """A field the step did not change keeps what other steps made of it."""
        assert merge(1, 1, 5, "x", []) == 5

    def test_appends_of_two_steps_both_land(self) -> None:
        """A list the step only appended to gets its additions after the live list's."""
        conflicts: list[str] = []
        assert merge([1], [1, 3], [1, 2], "x", conflicts) == [1, 2, 3]
        assert conflicts == []

    def test_items_changed_in_place_merge_by_index(self) -> None:
        """A list no step resized merges index by index (`counts[j] += 1` per thread)."""
        conflicts: list[str] = []
        assert merge([0, 0, 0], [1, 0, 0], [0, 0, 5], "c", conflicts) == [1, 0, 5]
        assert merge([0], [1], [2], "c", conflicts) == [1] and conflicts == ["c[0]"]

    def test_dict_keys_merge(self) -> None:
        """Keys added, changed or removed by one step each land; nested dicts too."""
        conflicts: list[str] = []
        base = {"a": 1, "gone": 0, "n": {"x": 1}}
        mine = {"a": 1, "b": 2, "n": {"x": 1, "y": 2}}
        live = {"a": 9, "gone": 0, "c": 3, "n": {"x": 5}}
        out = merge(base, mine, live, "d", conflicts)
        assert out == {"a": 9, "b": 2, "c": 3, "n": {"x": 5, "y": 2}}
        assert conflicts == []

    def test_scalar_changed_by_two_takes_the_later_and_reports(self) -> None:
        """The later completion wins a scalar another step changed meanwhile."""
        conflicts: list[str] = []
        assert merge({"k": 1}, {"k": 2}, {"k": 3}, "d", conflicts) == {"k": 2}
        assert conflicts == ["d.k"]

    def test_same_change_is_no_conflict(self) -> None:
        """Two steps setting one value is no conflict."""
        conflicts: list[str] = []
        assert merge(0, 2, 2, "x", conflicts) == 2 and conflicts == []


class TestForkApply:
    """Whole workflows: a copy per step, merged back."""

    def test_step_is_bound_to_its_copy(self) -> None:
        """The fork's step acts on the copy; the live data changes only on apply."""
        live = Bag()
        f = fork(live, "s0")
        f.copy.items.append(1)
        f.finish()
        assert live.items == []
        assert apply(live, f) == [] and live.items == [1]

    def test_unknown_step(self) -> None:
        """A step no longer in the definition is a clear error."""
        with pytest.raises(StepNotFound):
            fork(Bag(), "nope")

    def test_data_that_does_not_fit(self) -> None:
        """A step that leaves data its fields cannot hold fails, the live data untouched."""
        f = fork(Bag(), "s0")
        f.copy.last = "text"
        with pytest.raises(HandlerRejected):
            f.finish()


#: One step: the items it appends, whether it sets `own[s<i>]`, and whether it sets `last`.
step_ops = st.tuples(st.lists(st.integers(0, 99), max_size=3), st.booleans(), st.booleans())


@st.composite
def schedules(draw: st.DrawFn) -> tuple[list[tuple[list[int], bool, bool]], list[tuple[str, int]]]:
    """Draw steps and an interleaving of their starts and completions (each start first)."""
    ops = draw(st.lists(step_ops, min_size=1, max_size=STEPS))
    events = [("start", i) for i in range(len(ops))] + [("end", i) for i in range(len(ops))]
    order = draw(st.permutations(events))
    # Move each end after its start, keeping the order otherwise.
    seen: set[int] = set()
    fixed: list[tuple[str, int]] = []
    pending: list[tuple[str, int]] = []
    for kind, i in order:
        if kind == "start":
            seen.add(i)
            fixed.append((kind, i))
            fixed += [e for e in pending if e[1] == i]
            pending = [e for e in pending if e[1] != i]
        elif i in seen:
            fixed.append((kind, i))
        else:
            pending.append((kind, i))
    return ops, fixed


class TestInterleavings:
    """Random interleavings of completions give what the rule predicts."""

    @settings(max_examples=300, deadline=None)
    @given(schedules())
    def test_rule(self, drawn: tuple[list[tuple[list[int], bool, bool]], list[Any]]) -> None:
        """Appends land in completion order, own keys all land, `last` is the last
        completion's that set it, and a conflict is reported exactly when a step that set
        `last` completed while another one that set it ran."""
        ops, events = drawn
        live = Bag()
        forks: dict[int, Fork] = {}
        started_after: dict[int, int] = {}  # completions of `last` setters seen at start
        last_setters_done = 0
        expected_items: list[int] = []
        expected_last = -1
        for kind, i in events:
            appends, sets_own, sets_last = ops[i]
            if kind == "start":
                f = forks[i] = fork(live, f"s{i}")
                started_after[i] = last_setters_done
                f.copy.items.extend(appends)
                if sets_own:
                    f.copy.own[f"s{i}"] = i
                if sets_last:
                    f.copy.last = i
                continue
            f = forks.pop(i)
            f.finish()
            conflicts = apply(live, f)
            expected_items += appends
            if sets_last:
                if last_setters_done > started_after[i]:
                    assert conflicts == ["last"]
                else:
                    assert conflicts == []
                expected_last = i
                last_setters_done += 1
            else:
                assert conflicts == []
        assert live.items == expected_items
        assert live.own == {f"s{i}": i for i, (_, own, _) in enumerate(ops) if own}
        assert live.last == expected_last
