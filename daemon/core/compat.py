"""May a stored workflow run under a (new) class: the check reload, edit and recovery share."""

from __future__ import annotations

from daemon.core.definition import Definition, kind_of
from daemon.core.state import MAIN_THREAD, TEARDOWN_DUE, State, ThreadStatus
from daemon.core.workflow import Workflow

Registry = dict[str, type[Workflow]]

#: The statement kind a thread in each status must stop at.
_KIND_OF_STATUS = {
    ThreadStatus.EXECUTING: "step",
    ThreadStatus.WAITING_EVENT: "wait",
    ThreadStatus.WAITING_CONDITION: "wait_for",
}


def blockers(registry: Registry, name: str, data: str | bytes, state: State) -> list[str]:
    """Say why a live workflow could not continue under `registry`'s code (empty: it can)."""
    cls = registry.get(name)
    if cls is None:
        return [f"workflow type {name!r} is gone"]
    try:
        defn = Definition(cls.from_json(data).definition())
    except Exception as e:  # noqa: BLE001 - any failure of the new code blocks it
        return [f"new code cannot load it: {type(e).__name__}: {e}"]
    kinds = {name: kind_of(node) for name, node in defn.named.items()}
    found: list[str] = []
    for t in state.threads:
        if t.name != MAIN_THREAD and t.name not in defn.gos:
            found.append(f"thread {t.id}: Go {t.name!r} is gone")
        if not t.cur_step:
            continue
        want, have = _KIND_OF_STATUS.get(t.status), kinds.get(t.cur_step)
        if have is None:
            found.append(f"thread {t.id}: statement {t.cur_step!r} is gone")
        elif want is not None and have != want:
            found.append(f"thread {t.id}: {t.cur_step!r} is now a {have}, was a {want}")
        # A wait already let go of only awaits its teardown; with its event gone that is
        # recorded as a teardown error (as the engine does), so it does not keep the thread.
        found += [
            f"thread {t.id}: event {ev.req.name!r} is gone"
            for ev in t.wait_events
            if ev.req.name not in defn.events and ev.status not in TEARDOWN_DUE
        ]
    return found


def misfit(registry: Registry, name: str, data: str | bytes, state: State) -> str | None:
    """Say in one line why a live workflow does not fit `registry`'s code, or None if it does."""
    reasons = blockers(registry, name, data, state)
    return "; ".join(reasons) if reasons else None
