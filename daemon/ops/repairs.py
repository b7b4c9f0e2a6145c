"""Operator tools on live workflows: goto, edit, undo, retry, hold and release, graph and lint.

Every change runs while the workflow is held off (`exclusive`): no actor runs it and new work
for it is parked, so the change and the workflow's own progress never interleave.
"""

from __future__ import annotations

import dataclasses
import pwd
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Container
from typing import Any

import msgspec
import structlog

from daemon.core.compat import blockers, misfit
from daemon.core.definition import Definition, goto_targets
from daemon.core.lint import lint_workflow
from daemon.core.schedule import iso
from daemon.core.state import (
    FINAL_STATUSES,
    MAIN_THREAD,
    State,
    Thread,
    ThreadStatus,
    WorkflowStatus,
)
from daemon.core.statements import Section, definition_to_dict
from daemon.core.waits import handlers_of, release_thread, release_waits, teardown_waits
from daemon.core.workflow import Workflow
from daemon.errors import (
    BadInput,
    BadRequest,
    Conflict,
    ValidationError,
    WorkflowdError,
    WorkflowNotFound,
)
from daemon.ops.graph import render
from daemon.runtime.arming import Arms
from daemon.runtime.cache import Cache, Loaded
from daemon.runtime.scheduler import Scheduler
from daemon.runtime.work import Item
from daemon.store.base import Store, WorkflowRow

log = structlog.get_logger()
#: History kinds `undo` reverts; their detail keeps the before-image under "undo".
UNDOABLE = ("goto", "edit")
_REPAIRABLE = (WorkflowStatus.WAITING, WorkflowStatus.FAILED)


def _check(loaded: Loaded, what: str, *, unfit: bool = False) -> None:
    status = loaded.state.status
    # A workflow held for not fitting the code runs nothing, whatever its status says.
    if status in _REPAIRABLE or (unfit and status not in FINAL_STATUSES):
        return
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


class Repairs:
    """The operator's tools, given the runtime's parts they work with."""

    def __init__(
        self,
        *,
        store: Store,
        cache: Cache,
        scheduler: Scheduler,
        arms: Arms,
        recover: Callable[[WorkflowRow], Awaitable[str]],
        gc: Callable[[float], Awaitable[int]],
        keep_days: Callable[[], float],
        deadline: Callable[[str, float], None] = lambda workflow_id, at: None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._store, self._cache, self._scheduler, self._arms = store, cache, scheduler, arms
        #: Arms a workflow's deadline again (a retried one may run until it).
        self._deadline, self._now = deadline, now
        #: Resumes or re-arms one workflow as recovery does (for `resume`).
        self._recover = recover
        self._gc = gc
        #: The retention `gc` applies by default; a reload may change it.
        self._keep_days = keep_days

    async def _save(self, loaded: Loaded, kind: str, detail: dict[str, Any]) -> None:
        """Write the change and its history entry in one transaction, then start it moving."""
        s = loaded.state
        try:
            await self._store.checkpoint(
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
            self._cache.forget(s.id)
            raise
        self._cache.remember(loaded)
        log.info(f"workflow_{kind}", workflow_id=s.id, workflow=s.workflow, status=s.status.value)
        if s.status in FINAL_STATUSES:
            return
        self._refit(loaded)
        if not self._scheduler.hold.holds(s.id):
            self._arms.rearm(loaded.wf, s)
        # One resume pass sets up new waits and re-checks WaitFor conditions on the new data.
        self._scheduler.submit(s.id, Item("resume"))

    def _unfit(self, workflow_id: str) -> bool:
        return workflow_id in self._scheduler.hold.incompatible

    def _still_unfit(self, workflow_id: str) -> dict[str, str]:
        """Say, in a repair's answer, that the workflow is still held for not fitting the code."""
        reason = self._scheduler.hold.incompatible.get(workflow_id)
        return {} if reason is None else {"incompatible": reason}

    def _refit(self, loaded: Loaded) -> None:
        """Check a repaired workflow against the code: hold it if it does not fit, else let go."""
        s, unfit = loaded.state, self._scheduler.hold.incompatible
        reason = misfit(self._cache.registry, s.workflow, loaded.wf.to_json(), s)
        if reason is None:
            if unfit.pop(s.id, None) is not None:
                log.info("workflow_fits", workflow_id=s.id, workflow=s.workflow)
            return
        if unfit.get(s.id) != reason:
            log.error("workflow_incompatible", workflow_id=s.id, workflow=s.workflow, reason=reason)
        unfit[s.id] = reason
        self._arms.disarm_workflow(s.id)

    async def goto(
        self, workflow_id: str, thread_id: str, statement: str, *, who: int | None = None
    ) -> dict[str, Any]:
        """Move one thread of a waiting or failed workflow to `statement`, then resume it."""
        async with self._scheduler.exclusive(workflow_id) as loaded:
            _check(loaded, "goto", unfit=self._unfit(workflow_id))
            s = loaded.state
            t = s.thread(thread_id)
            if t is None:
                names = ", ".join(th.id for th in s.threads)
                raise WorkflowNotFound(
                    f"workflow {workflow_id} has no thread {thread_id!r} ({names})"
                )
            root = _definition(loaded.wf)
            go = Definition(root).gos.get(t.name)
            if t.name != MAIN_THREAD and go is None:
                raise Conflict(f"thread {thread_id}: its Go {t.name!r} is gone from the definition")
            found = goto_targets(root if go is None else go.body)
            target = found.get(statement)
            if target is None or target.kind == "go":
                why = f"{statement!r} is a Go, not a goto target" if target else f"no {statement!r}"
                names = ", ".join(sorted(k for k, v in found.items() if v.kind != "go"))
                raise WorkflowNotFound(f"thread {thread_id}: {why}; targets: {names}")
            before, was = _image(loaded), _thread(t)
            _revive(loaded)
            release_thread(t)
            _move(t, statement, target.kind, target.wait)
            t.pc += 1
            s.pc += 1
            s.update_status()
            detail = {**_who(who), "thread": thread_id, "statement": statement}
            detail["target"] = target.kind
            await self._save(
                loaded, "goto", {**detail, "before": was, "after": _thread(t), "undo": before}
            )
            out = {"workflow_id": workflow_id, "status": s.status.value, "thread": _thread(t)}
            return {**out, **self._still_unfit(workflow_id)}

    async def edit(
        self, workflow_id: str, values: dict[str, Any], *, who: int | None = None
    ) -> dict[str, Any]:
        """Replace data fields of a waiting or failed workflow, checked against their types."""
        async with self._scheduler.exclusive(workflow_id) as loaded:
            _check(loaded, "edit", unfit=self._unfit(workflow_id))
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
            if reasons:  # only what the new data breaks: a workflow held unfit may be edited
                was = blockers({cls.name: cls}, s.workflow, loaded.wf.to_json(), s)
                reasons = [r for r in reasons if r not in was]
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
            await self._save(loaded, "edit", detail)
            out = {"workflow_id": workflow_id, "status": s.status.value, "data": now}
            return {**out, **self._still_unfit(workflow_id)}

    async def undo(self, workflow_id: str, *, who: int | None = None) -> dict[str, Any]:
        """Put back the data and state from before the last goto or edit not undone yet."""
        async with self._scheduler.exclusive(workflow_id) as loaded:
            _check(loaded, "undo", unfit=self._unfit(workflow_id))
            pending = 0
            for row in reversed(await self._store.history(workflow_id)):
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
                wf = type(loaded.wf).from_json(msgspec.json.encode(image["data"]))
            except (msgspec.ValidationError, KeyError, TypeError) as e:
                raise Conflict(
                    f"the {row.kind} cannot be undone: its saved image is unusable: {e}"
                ) from e
            old = Loaded(wf, state, attempt=image.get("attempt", 0), error=image.get("error"))
            await self._teardown_gone(loaded, state)
            detail = {**_who(who), "reverts": row.kind, "reverts_at": row.at}
            await self._save(old, "undo", detail)
            out = {"workflow_id": workflow_id, "status": state.status.value, "reverted": row.kind}
            return {**out, **self._still_unfit(workflow_id)}

    async def _teardown_gone(self, loaded: Loaded, keep: State) -> None:
        """Tear down the waits of the current state that the restored one does not have."""
        kept = {(t.id, ev.req.name, ev.req.pc) for t in keep.threads for ev in t.wait_events}
        self._arms.disarm_workflow(loaded.state.id)
        # The current state is dropped after this, so failures are only logged.
        release_waits(loaded.state)
        failed = await teardown_waits(loaded.state, handlers_of(loaded.wf), keep=kept)
        if failed:
            errors = [ev.error for t in loaded.state.threads for ev in t.wait_events if ev.error]
            log.warning("undo_teardown_failed", failed=failed, errors=errors)

    async def retry(
        self, workflow_id: str, *, who: int | None = None, by: str | None = None
    ) -> dict[str, Any]:
        """Resume a failed workflow from where it failed, with a fresh attempt count.

        `by` names who asked ("dashboard"), for the history record. One whose deadline
        (`timeout_s`) has passed is refused: it would only be cancelled again at once.
        """
        async with self._scheduler.exclusive(workflow_id) as loaded:
            if loaded.state.status is not WorkflowStatus.FAILED:
                raise Conflict(f"workflow {workflow_id} is {loaded.state.status}, not Failed")
            row = await self._store.get(workflow_id)
            deadline = None if row is None else row.deadline
            if deadline is not None and deadline <= self._now():
                raise Conflict(
                    f"workflow {workflow_id}'s deadline passed at {iso(deadline)}; "
                    "start it again instead"
                )
            error = loaded.error
            _revive(loaded)
            loaded.state.update_status()
            by_whom = {"by": by} if by is not None else {}
            await self._save(loaded, "retry", {**_who(who), **by_whom, "error": error})
            if deadline is not None:
                self._deadline(workflow_id, deadline)
            out = {"workflow_id": workflow_id, "status": loaded.state.status.value}
            return {**out, **self._still_unfit(workflow_id)}

    async def release(self, workflow_id: str) -> dict[str, Any]:
        """Let one held workflow run: arm its waits and resume it."""
        row = await self._store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        hold = self._scheduler.hold
        was_held = hold.holds(workflow_id)
        out: dict[str, Any] = {"workflow_id": workflow_id, "status": row.status}
        if was_held:
            hold.released.add(workflow_id)
            if row.status not in FINAL_STATUSES:
                await self._recover(row)
            self._scheduler.unpark(workflow_id)
            unfit = hold.incompatible.get(workflow_id)
            if unfit is not None:  # still held: it does not fit the running code
                return {**out, "released": False, "incompatible": unfit}
            log.info("workflow_released", workflow_id=workflow_id)
        return {**out, "released": was_held}

    async def release_all(self) -> dict[str, Any]:
        """End the hold of `workflowd --hold`: every held workflow runs again."""
        hold = self._scheduler.hold
        if not hold.held:
            return {"released": 0}
        hold.held = False
        count = 0
        async for row in self._store.unfinished():
            if row.id not in hold.released:
                await self._recover(row)
                count += row.id not in hold.incompatible
        for wid in [w for w in hold.parked if w not in hold.busy]:
            self._scheduler.unpark(wid)
        hold.released.clear()
        log.info("hold_released", workflows=count)
        return {"released": count}

    async def graph(self, workflow: str, workflow_id: str | None, format: str) -> str:
        """Draw a workflow type's definition; with an id, that workflow's own, with its positions."""
        cls = self._cache.workflow_type(workflow)
        state: State | None = None
        failed: list[str] = []
        if workflow_id:
            row = await self._store.get(workflow_id)
            if row is None:
                raise WorkflowNotFound(f"no workflow {workflow_id!r}")
            if row.name != workflow:
                raise Conflict(f"workflow {workflow_id} is a {row.name}, not a {workflow}")
            loaded = self._cache.decode(row)
            wf, state = loaded.wf, loaded.state
            if state.status is WorkflowStatus.FAILED:
                rows = await self._store.history(workflow_id, limit=100)
                failed = [str(r.detail.get("step", "")) for r in rows if r.kind == "step_failed"]
        else:
            try:
                wf = cls.from_input(None)
            except WorkflowdError as e:
                raise BadRequest(f"{workflow} needs field values; give a workflow id: {e}") from e
        title = f"{workflow} {workflow_id}" if workflow_id else workflow
        tree = definition_to_dict(_definition(wf))
        kids = {}
        if workflow_id and state is not None:
            kids = await self._children_of(workflow_id, state, Definition(_definition(wf)).events)
        return render(
            tree, format, state=state, title=title, failed_step=(failed or [""])[-1], children=kids
        )

    async def _children_of(
        self, workflow_id: str, state: State, events: Container[str]
    ) -> dict[str, str]:
        """Return, per Child case, the text naming its children: `child <id>: <status>`."""
        rows = await self._store.list(parent=workflow_id, limit=1000)
        status = {r.id: r.status for r in rows}
        by_event: dict[str, dict[str, None]] = {}
        # A default child id is `<parent>/<event>/...`: the cases that fired are found by it.
        for r in sorted(rows, key=lambda r: r.created_at):
            event = r.id.removeprefix(f"{workflow_id}/").partition("/")[0]
            if r.id.startswith(f"{workflow_id}/") and event in events:
                by_event.setdefault(event, {})[r.id] = None
        for t in state.threads:
            for ev in t.wait_events:
                if ev.type == "child" and ev.req.setup_data:
                    try:
                        cid = str(msgspec.json.decode(ev.req.setup_data)["child"])
                    except (msgspec.DecodeError, KeyError, TypeError):
                        continue
                    by_event.setdefault(ev.req.name, {})[cid] = None
        out = {}
        for event, ids in by_event.items():
            if len(ids) == 1:
                (cid,) = ids
                out[event] = f"child {cid}: {status.get(cid, 'gone')}"
            else:
                counts = Counter(status.get(cid, "gone") for cid in ids)
                summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                out[event] = f"{len(ids)} children: {summary}"
        return out

    async def lint(self, workflow: str) -> list[dict[str, Any]]:
        """Check a workflow type's definition."""
        return [f.to_dict() for f in lint_workflow(self._cache.workflow_type(workflow))]

    async def collect_garbage(self, keep_days: float | None = None) -> dict[str, Any]:
        """Delete finished workflows older than `keep_days` (default: `[store] keep_finished_days`)."""
        days = self._keep_days() if keep_days is None else keep_days
        if keep_days is None and days <= 0:
            return {
                "deleted": 0,
                "keep_days": days,
                "note": "retention is off (keep_finished_days = 0)",
            }
        deleted = await self._gc(days)
        log.info("workflows_deleted", count=deleted, older_than_days=days)
        return {"deleted": deleted, "keep_days": days}


def _revive(loaded: Loaded) -> None:
    """Make a failed workflow live again: threads that waited set their waits up anew."""
    s = loaded.state
    if s.status is WorkflowStatus.FAILED:
        for t in s.threads:
            if t.status is ThreadStatus.WAITING_EVENT:  # its waits were torn down on failure
                t.status, t.cur_callback = ThreadStatus.RESUMING, ""
        s.status = WorkflowStatus.RESUMING
    loaded.error, loaded.attempt, loaded.next_run_at = None, 0, None


def _move(t: Thread, name: str, kind: str, wait: str) -> None:
    """Point the thread at `name` so the engine's search mode does what goto means."""
    t.cur_callback = ""
    if kind == "step":  # run it
        t.cur_step, t.status = name, ThreadStatus.EXECUTING
    elif kind == "wait_for":  # wait here (RESUMING would continue after it)
        t.cur_step, t.status = name, ThreadStatus.WAITING_CONDITION
    elif kind == "event":  # run the case's body, as if the event had come
        t.cur_step, t.cur_callback, t.status = wait, name, ThreadStatus.RESUMING
    else:  # a Wait waits anew; a For re-enters its loop; a branch runs its body
        t.cur_step, t.status = name, ThreadStatus.RESUMING


def _definition(wf: Workflow) -> Section:
    try:
        return wf.definition()
    except WorkflowdError:
        raise
    except Exception as e:
        raise ValidationError(f"definition() raised {type(e).__name__}: {e}") from e
