"""Operator tools on live workflows: goto, edit, undo, retry, hold and release, graph and lint.

Every change runs while the workflow is held off (`exclusive`): no actor runs it and new work
for it is parked, so the change and the workflow's own progress never interleave.
"""

from __future__ import annotations

import dataclasses
import pwd
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from daemon.core.lint import lint_workflow
from daemon.core.state import (
    FINAL_STATUSES,
    MAIN_THREAD,
    EventStatus,
    State,
    Thread,
    ThreadStatus,
    WorkflowStatus,
)
from daemon.core.statements import (
    Definition,
    Go,
    Stmt,
    Wait,
    _Branching,
    children,
    definition_to_dict,
)
from daemon.core.statements import For as ForStmt
from daemon.core.statements import Step as StepStmt
from daemon.core.statements import WaitFor as WaitForStmt
from daemon.core.workflow import Workflow
from daemon.errors import (
    BadInput,
    BadRequest,
    Conflict,
    UnknownWorkflowType,
    ValidationError,
    WorkflowError,
    WorkflowNotFound,
)
from daemon.ops.graph import render
from daemon.ops.reload import blockers
from daemon.runtime.actor import Item, Loaded
from daemon.store.sqlite import FINAL

if TYPE_CHECKING:
    from daemon.runtime.runtime import Runtime

log = structlog.get_logger()
#: How long a change waits for a workflow that is taking a callback to block again.
BUSY_WAIT_S = 5.0
#: History kinds `undo` reverts; their detail keeps the before-image under "undo".
UNDOABLE = ("goto", "edit")
_REPAIRABLE = (WorkflowStatus.WAITING, WorkflowStatus.FAILED)
_LIVE = (EventStatus.SETUP, EventStatus.SETUP_ERROR)


class Hold:
    """Which workflows may not run now; work queued for them is parked until they may."""

    def __init__(self, held: bool) -> None:
        #: Set by `workflowd --hold` until `resume-all`.
        self.held = held
        self.released: set[str] = set()
        self.busy: set[str] = set()
        self.parked: dict[str, list[Item]] = {}

    def holds(self, workflow_id: str) -> bool:
        """Tell whether the workflow is held (`workflowd --hold` and not released)."""
        return self.held and workflow_id not in self.released

    def park(self, workflow_id: str, item: Item) -> bool:
        """Keep `item` for later if its workflow may not run now; a cancel passes a hold."""
        if workflow_id in self.busy or (self.holds(workflow_id) and item.kind != "cancel"):
            self.parked.setdefault(workflow_id, []).append(item)
            return True
        return False


@asynccontextmanager
async def exclusive(rt: Runtime, workflow_id: str) -> AsyncIterator[Loaded]:
    """Keep the workflow's actor and callbacks off it; yield it fresh from the store."""
    hold = rt.hold
    if workflow_id in hold.busy:
        raise Conflict(f"workflow {workflow_id} is being changed by another request")
    hold.busy.add(workflow_id)
    try:
        actor = rt.actors.get(workflow_id)
        if actor is not None:
            # A workflow taking a callback blocks again soon; one running steps may not.
            c = rt.cache.get(workflow_id)
            if c and c.state.status is not WorkflowStatus.RESUMING and c.next_run_at is None:
                with anyio.move_on_after(BUSY_WAIT_S):
                    await actor.done.wait()
            if workflow_id in rt.actors:
                raise Conflict(f"workflow {workflow_id} is running; wait until it waits or fails")
        rt.forget(workflow_id)
        yield await rt.load(workflow_id)
    finally:
        hold.busy.discard(workflow_id)
        for item in hold.parked.pop(workflow_id, []):
            rt.submit(workflow_id, item)


def _check(loaded: Loaded, what: str) -> None:
    status = loaded.state.status
    if status not in _REPAIRABLE:
        raise Conflict(f"workflow {loaded.state.id} is {status}; {what} needs Waiting or Failed")


def _who(uid: int | None) -> dict[str, Any]:
    if uid is None:
        return {}
    try:
        return {"uid": uid, "user": pwd.getpwuid(uid).pw_name}
    except KeyError:
        return {"uid": uid}


def _image(loaded: Loaded) -> dict[str, Any]:
    """Capture everything `undo` puts back."""
    return {
        "data": msgspec.json.decode(loaded.wf.to_json()),
        "state": msgspec.json.decode(loaded.state.to_json()),
        "error": loaded.error,
        "attempt": loaded.attempt,
    }


def _thread(t: Thread) -> dict[str, Any]:
    return {"status": t.status.value, "cur_step": t.cur_step, "cur_callback": t.cur_callback}


async def _save(rt: Runtime, loaded: Loaded, kind: str, detail: dict[str, Any]) -> None:
    """Write the change and its history entry in one transaction, then start it moving."""
    s = loaded.state
    try:
        await rt.store.checkpoint(
            s.id,
            status=s.status.value,
            data=loaded.wf.to_json(),
            state=s.to_json(),
            error=loaded.error,
            attempt=loaded.attempt,
            next_run_at=loaded.next_run_at,
            history=[(kind, detail)],
        )
    except BaseException:
        rt.forget(s.id)
        raise
    rt.remember(loaded)
    log.info(f"workflow_{kind}", workflow_id=s.id, workflow=s.workflow, status=s.status.value)
    if s.status in FINAL_STATUSES:
        return
    if not rt.hold.holds(s.id):
        rt.rearm(loaded)
    # One resume pass sets up new waits and re-checks WaitFor conditions on the new data.
    rt.submit(s.id, Item("resume"))


def _revive(loaded: Loaded) -> None:
    """Make a failed workflow live again: threads that waited set their waits up anew."""
    s = loaded.state
    if s.status is WorkflowStatus.FAILED:
        for t in s.threads:
            if t.status is ThreadStatus.WAITING_EVENT:  # its waits were torn down on failure
                t.status, t.cur_callback = ThreadStatus.RESUMING, ""
        s.status = WorkflowStatus.RESUMING
    loaded.error, loaded.attempt, loaded.next_run_at = None, 0, None


def _release(t: Thread) -> None:
    t.wait_events = [ev for ev in t.wait_events if ev.status is not EventStatus.PENDING_SETUP]
    for ev in t.wait_events:
        if ev.status in _LIVE:
            ev.status = EventStatus.PENDING_TEARDOWN


def targets(body: Stmt) -> dict[str, tuple[str, str]]:
    """Map each goto target in a thread's body to its kind and, for a Wait case, its Wait."""
    found: dict[str, tuple[str, str]] = {}
    stack = list(children(body))
    while stack:
        s = stack.pop()
        match s:
            case StepStmt(name=n) | WaitForStmt(name=n) | ForStmt(name=n) | Go(name=n):
                found[n] = (type(s).__name__.lower(), "")
            case Wait(name=n, cases=cases):
                found[n] = ("wait", "")
                found.update((c.event, ("event", n)) for c in cases)
            case _Branching(branches=branches):
                found.update((b.name, ("branch", "")) for b in branches)
        if not isinstance(s, Go):  # a Go body belongs to another thread
            stack.extend(children(s))
    return found


def _move(t: Thread, name: str, kind: str, wait: str) -> None:
    """Point the thread at `name` so the engine's search mode does what goto means."""
    t.cur_callback = ""
    if kind == "step":  # run it
        t.cur_step, t.status = name, ThreadStatus.EXECUTING
    elif kind == "waitfor":  # wait here (RESUMING would continue after it)
        t.cur_step, t.status = name, ThreadStatus.WAITING_CONDITION
    elif kind == "event":  # run the case's body, as if the event had come
        t.cur_step, t.cur_callback, t.status = wait, name, ThreadStatus.RESUMING
    else:  # a Wait waits anew; a For re-enters its loop; a branch runs its body
        t.cur_step, t.status = name, ThreadStatus.RESUMING


async def goto(
    rt: Runtime, workflow_id: str, thread_id: str, statement: str, who: int | None
) -> dict[str, Any]:
    """Move one thread of a waiting or failed workflow to `statement`, then resume it."""
    async with exclusive(rt, workflow_id) as loaded:
        _check(loaded, "goto")
        s = loaded.state
        t = s.thread(thread_id)
        if t is None:
            names = ", ".join(th.id for th in s.threads)
            raise WorkflowNotFound(f"workflow {workflow_id} has no thread {thread_id!r} ({names})")
        root = _definition(loaded.wf)
        go = Definition(root).gos.get(t.name)
        if t.name != MAIN_THREAD and go is None:
            raise Conflict(f"thread {thread_id}: its Go {t.name!r} is gone from the definition")
        found = targets(root if go is None else go.body)
        kind, wait = found.get(statement, ("", ""))
        if kind in ("", "go"):
            why = f"{statement!r} is a Go, not a goto target" if kind else f"no {statement!r}"
            targets_ = ", ".join(sorted(k for k, v in found.items() if v[0] != "go"))
            raise WorkflowNotFound(f"thread {thread_id}: {why}; targets: {targets_}")
        before, was = _image(loaded), _thread(t)
        _revive(loaded)
        _release(t)
        _move(t, statement, kind, wait)
        t.pc += 1
        s.pc += 1
        s.update_status()
        detail = {**_who(who), "thread": thread_id, "statement": statement, "target": kind}
        await _save(
            rt, loaded, "goto", {**detail, "before": was, "after": _thread(t), "undo": before}
        )
        return {"workflow_id": workflow_id, "status": s.status.value, "thread": _thread(t)}


async def edit(
    rt: Runtime, workflow_id: str, values: dict[str, Any], who: int | None
) -> dict[str, Any]:
    """Replace data fields of a waiting or failed workflow, checked against their types."""
    async with exclusive(rt, workflow_id) as loaded:
        _check(loaded, "edit")
        cls, s = type(loaded.wf), loaded.state
        known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(values) - set(known))
        if unknown or not values:
            what = f"has no field {', '.join(unknown)}" if unknown else "needs fields to set"
            raise BadRequest(f"edit: {cls.name} {what}; fields: {', '.join(known)}")
        old = msgspec.json.decode(loaded.wf.to_json())
        try:
            new = cls.from_json(msgspec.json.encode({**old, **values}))
        except msgspec.ValidationError as e:
            raise BadInput(f"edit: {e}") from None
        reasons = blockers({cls.name: cls}, s.workflow, new.to_json(), s)
        if reasons:
            raise BadInput(
                f"edit: the workflow could not go on with this data: {'; '.join(reasons)}"
            )
        before = _image(loaded)
        loaded.wf = new
        now = msgspec.json.decode(new.to_json())
        detail = {
            **_who(who),
            "before": {k: old.get(k) for k in values},
            "after": {k: now.get(k) for k in values},
            "undo": before,
        }
        await _save(rt, loaded, "edit", detail)
        return {"workflow_id": workflow_id, "status": s.status.value, "data": now}


async def undo(rt: Runtime, workflow_id: str, who: int | None) -> dict[str, Any]:
    """Put back the data and state from before the last goto or edit not undone yet."""
    async with exclusive(rt, workflow_id) as loaded:
        _check(loaded, "undo")
        pending = 0
        for row in reversed(await rt.store.history(workflow_id)):
            if row.kind == "undo":
                pending += 1
            elif row.kind in UNDOABLE and "undo" in row.detail:
                if not pending:
                    break
                pending -= 1
        else:
            raise Conflict(f"workflow {workflow_id} has no goto or edit left to undo")
        image = row.detail["undo"]
        try:
            state = State.from_json(msgspec.json.encode(image["state"]))
            old = Loaded(type(loaded.wf).from_json(msgspec.json.encode(image["data"])), state)
        except (msgspec.ValidationError, KeyError, TypeError) as e:
            raise Conflict(
                f"the {row.kind} cannot be undone: its saved image is unusable: {e}"
            ) from e
        old.error, old.attempt = image.get("error"), image.get("attempt", 0)
        await _teardown_gone(rt, loaded, state)
        detail = {**_who(who), "reverts": row.kind, "reverts_at": row.at}
        await _save(rt, old, "undo", detail)
        return {"workflow_id": workflow_id, "status": state.status.value, "reverted": row.kind}


async def _teardown_gone(rt: Runtime, loaded: Loaded, keep: State) -> None:
    """Tear down the waits of the current state that the restored one does not have set up."""
    kept = {(t.id, ev.req.name, ev.req.pc) for t in keep.threads for ev in t.wait_events}
    rt.arms.disarm_workflow(loaded.state.id)
    try:
        events = Definition(loaded.wf.definition()).events
    except Exception:  # noqa: BLE001 - a broken definition has no handlers to call
        return
    for t in loaded.state.threads:
        for ev in t.wait_events:
            on = events.get(ev.req.name)
            if on is None or (t.id, ev.req.name, ev.req.pc) in kept:
                continue
            if ev.status in (*_LIVE, EventStatus.PENDING_TEARDOWN, EventStatus.TEARDOWN_ERROR):
                try:
                    await on.handler.teardown(ev.req, ev.handled)
                except Exception as e:  # noqa: BLE001 - logged; the undo goes on
                    log.warning("undo_teardown_failed", event_name=ev.req.name, error=str(e))


async def retry(rt: Runtime, workflow_id: str, who: int | None) -> dict[str, Any]:
    """Resume a failed workflow from where it failed, with a fresh attempt count."""
    async with exclusive(rt, workflow_id) as loaded:
        if loaded.state.status is not WorkflowStatus.FAILED:
            raise Conflict(f"workflow {workflow_id} is {loaded.state.status}, not Failed")
        error = loaded.error
        _revive(loaded)
        loaded.state.update_status()
        await _save(rt, loaded, "retry", {**_who(who), "error": error})
        return {"workflow_id": workflow_id, "status": loaded.state.status.value}


async def release(rt: Runtime, workflow_id: str) -> dict[str, Any]:
    """Let one held workflow run: arm its waits and resume it."""
    row = await rt.store.get(workflow_id)
    if row is None:
        raise WorkflowNotFound(f"no workflow {workflow_id!r}")
    was_held = rt.hold.holds(workflow_id)
    if was_held:
        rt.hold.released.add(workflow_id)
        if row.status not in FINAL:
            await rt.recover_one(row)
        for item in rt.hold.parked.pop(workflow_id, []):
            rt.submit(workflow_id, item)
        log.info("workflow_released", workflow_id=workflow_id)
    return {"workflow_id": workflow_id, "status": row.status, "released": was_held}


async def release_all(rt: Runtime) -> dict[str, Any]:
    """End the hold of `workflowd --hold`: every held workflow runs again."""
    hold = rt.hold
    if not hold.held:
        return {"released": 0}
    hold.held = False
    count = 0
    async for row in rt.store.unfinished():
        if row.id not in hold.released:
            await rt.recover_one(row)
            count += 1
    for wid in [w for w in hold.parked if w not in hold.busy]:
        for item in hold.parked.pop(wid):
            rt.submit(wid, item)
    hold.released.clear()
    log.info("hold_released", workflows=count)
    return {"released": count}


def _definition(wf: Workflow) -> Any:
    try:
        return wf.definition()
    except WorkflowError:
        raise
    except Exception as e:
        raise ValidationError(f"definition() raised {type(e).__name__}: {e}") from e


def _workflow_type(rt: Runtime, workflow: str) -> type[Workflow]:
    cls = rt.registry.get(workflow)
    if cls is None:
        known = ", ".join(sorted(rt.registry)) or "none"
        raise UnknownWorkflowType(f"no workflow type {workflow!r} (known: {known})")
    return cls


async def graph(rt: Runtime, workflow: str, workflow_id: str | None, fmt: str) -> str:
    """Draw a workflow type's definition; with an id, that workflow's own, with its positions."""
    cls = _workflow_type(rt, workflow)
    state: State | None = None
    failed: list[str] = []
    if workflow_id:
        row = await rt.store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        if row.name != workflow:
            raise Conflict(f"workflow {workflow_id} is a {row.name}, not a {workflow}")
        loaded = rt.decode(row)
        wf, state = loaded.wf, loaded.state
        if state.status is WorkflowStatus.FAILED:
            rows = await rt.store.history(workflow_id, limit=100)
            failed = [str(r.detail.get("step", "")) for r in rows if r.kind == "step_failed"]
    else:
        try:
            wf = cls.from_input(None)
        except WorkflowError as e:
            raise BadRequest(f"{workflow} needs field values; give a workflow id: {e}") from e
    title = f"{workflow} {workflow_id}" if workflow_id else workflow
    tree = definition_to_dict(_definition(wf))
    return render(tree, fmt, state=state, title=title, failed_step=(failed or [""])[-1])


def lint(rt: Runtime, workflow: str) -> list[dict[str, Any]]:
    """Check a workflow type's definition."""
    return [f.to_dict() for f in lint_workflow(_workflow_type(rt, workflow))]


async def collect_garbage(rt: Runtime, keep_days: float | None) -> dict[str, Any]:
    """Delete finished workflows older than `keep_days` (default: `[store] keep_finished_days`)."""
    days = rt.settings.keep_finished_days if keep_days is None else keep_days
    if keep_days is None and days <= 0:
        return {
            "deleted": 0,
            "keep_days": days,
            "note": "retention is off (keep_finished_days = 0)",
        }
    deleted = await rt.gc(days)
    log.info("workflows_deleted", count=deleted, older_than_days=days)
    return {"deleted": deleted, "keep_days": days}
