"""Per-step copies of a workflow's data and the per-field rule that merges their changes back."""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass, field
from typing import Any

import msgspec

from daemon.core.statements import Step, walk
from daemon.errors import HandlerRejected, StepNotFound

_encoder = msgspec.json.Encoder()
_MISSING: Any = msgspec.UNSET  # a dict key absent on one side (never a stored value)


@dataclass(slots=True)
class Fork:
    """A copy of a workflow's data that one step runs against, and the data it started from."""

    #: The copy; `step` is bound to it, never to the live workflow.
    copy: Any
    step: Step
    #: The copy's fields at the start, as JSON builtins.
    base: dict[str, Any]
    #: The copy's fields once the step has returned (set by `finish`).
    result: dict[str, Any] = field(default_factory=dict)
    #: Set when the step runs on the live data itself (no other step can overlap it): the
    #: data as it was, put back by `discard` if the step fails.
    undo: bytes | None = None

    def finish(self) -> None:
        """Record what the step left in its copy; raise HandlerRejected if that cannot be stored."""
        if self.undo is not None:
            return  # its changes are in place already
        self.result = msgspec.to_builtins(self.copy)
        try:
            msgspec.convert(self.result, type=type(self.copy))
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            raise HandlerRejected(
                f"step {self.step.name!r} left data {type(self.copy).__name__}'s fields "
                f"cannot hold: {e}"
            ) from e

    def discard(self) -> None:
        """Forget what a failed step did: put data it changed in place back as it was."""
        if self.undo is not None:
            self.copy.restore(self.undo)


def fork(wf: Any, step: Step | str, *, alone: bool = False) -> Fork:
    """Copy the workflow's data and give the copy its own `step` (a Step of `wf`, or a name).

    `alone` tells that no other step can start before this one has ended: it then runs on
    the live data, undone if it fails, as a copy would be dropped. Not a step with a timeout:
    past it, a sync step's abandoned thread goes on changing the data it was given.
    """
    snap = _encoder.encode(wf)
    if alone and isinstance(step, Step) and not step.timeout:
        return Fork(wf, step, {}, undo=snap)
    copy = msgspec.json.decode(snap, type=type(wf))
    found = None
    if isinstance(step, Step):
        action = _rebind(step.action, wf, copy)
        if action is not None:
            found = dataclasses.replace(step, action=action)
        step = step.name
    if found is None:
        # An action that is not a method of the data (a lambda, say) may read it anywhere:
        # the copy's own definition binds it to the copy.
        found = next(
            (s for s in walk(copy.definition()) if isinstance(s, Step) and s.name == step), None
        )
    if found is None:
        raise StepNotFound(f"step {step!r} is not in the definition")
    return Fork(copy, found, msgspec.json.decode(snap))


def _rebind(action: Any, live: Any, copy: Any) -> Any:
    """Return `action` acting on `copy` instead of `live`, or None if it cannot be told how."""
    if isinstance(action, types.MethodType):
        return types.MethodType(action.__func__, copy) if action.__self__ is live else None
    if isinstance(action, functools.partial):
        func = _rebind(action.func, live, copy)
        if func is None or any(a is live for a in (*action.args, *action.keywords.values())):
            return None
        return functools.partial(func, *action.args, **action.keywords)
    return None


def apply(wf: Any, done: Fork) -> list[str]:
    """Merge a finished step's changes into the live workflow; return the conflicting fields.

    A field the step did not change keeps its live value, whatever other steps did to it.
    """
    if done.undo is not None:
        return []  # it ran on `wf` itself
    changed = [k for k, v in done.result.items() if done.base.get(k, _MISSING) != v]
    if not changed:
        return []
    live = msgspec.to_builtins(wf)
    conflicts: list[str] = []
    for k in changed:
        value = merge(
            done.base.get(k, _MISSING), done.result[k], live.get(k, _MISSING), k, conflicts
        )
        live[k] = value
    fresh = msgspec.convert(live, type=type(wf))
    for k in changed:
        setattr(wf, k, getattr(fresh, k))
    return conflicts


def merge(base: Any, mine: Any, live: Any, path: str, conflicts: list[str]) -> Any:
    """Return the value a field takes when a step turned `base` into `mine` and it is now `live`.

    Lists the step only appended to get its additions appended to the live list; lists whose
    length no step changed merge index by index; dicts merge key by key (recursively); any other change wins over a different concurrent one, and its
    path is added to `conflicts`. `_MISSING` stands for a dict key that is absent.
    """
    if mine == base:
        return live
    if live == base:
        return mine
    appended = isinstance(mine, list) and isinstance(base, list) and mine[: len(base)] == base
    if appended and isinstance(live, list):
        return live + mine[len(base) :]
    if _same_length(base, mine, live):
        # Items changed in place (`counts[j] += 1` in thread j) merge one index at a time.
        return [
            merge(b, m, v, f"{path}[{i}]", conflicts)
            for i, (b, m, v) in enumerate(zip(base, mine, live, strict=True))
        ]
    if isinstance(mine, dict) and isinstance(base, dict) and isinstance(live, dict):
        out = dict(live)
        for k in {**base, **mine}:
            b, m = base.get(k, _MISSING), mine.get(k, _MISSING)
            if b == m:
                continue
            v = merge(b, m, live.get(k, _MISSING), f"{path}.{k}", conflicts)
            if v is _MISSING:
                out.pop(k, None)
            else:
                out[k] = v
        return out
    if live == mine:  # the same change (after the list rule: equal appends both land)
        return mine
    conflicts.append(path)
    return mine


def _same_length(base: Any, mine: Any, live: Any) -> bool:
    if not (isinstance(base, list) and isinstance(mine, list) and isinstance(live, list)):
        return False
    return len(base) == len(mine) == len(live)
