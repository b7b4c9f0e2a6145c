"""Waiting for workflows to end: woken by each actor's exit, never by polling."""

from __future__ import annotations

import builtins
import dataclasses
import math
import typing
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import msgspec

from daemon.core.state import FINAL_STATUSES, WorkflowStatus
from daemon.core.workflow import Workflow
from daemon.errors import Unavailable, WorkflowNotFound
from daemon.store.base import Store, WorkflowRow

_FINAL = frozenset(s.value for s in FINAL_STATUSES)


class _Waker:
    """One waiting request's event, renewed before each look, and the ids that exited since."""

    def __init__(self, ids: Iterable[str]) -> None:
        self.event = anyio.Event()
        #: Looked at on the next turn: every id on the first, then only those that exited.
        self.due: set[str] = set(ids)

    def wake(self, workflow_id: str) -> None:
        """Note that the workflow's actor exited, and wake the waiter."""
        self.due.add(workflow_id)
        self.event.set()


class Endings:
    """Answers `wait` requests; the scheduler tells it each workflow whose actor exited."""

    def __init__(
        self,
        *,
        store: Store,
        running: Callable[[str], bool],
        workflow_type: Callable[[str], type[Workflow] | None],
        elsewhere: Callable[[WorkflowRow], bool] = lambda row: False,
    ) -> None:
        self._store, self._running, self._type = store, running, workflow_type
        #: Whether a stored workflow may be running on another daemon (a shared store).
        self._elsewhere = elsewhere
        self._wakers: dict[str, set[_Waker]] = {}
        self._stopping = False

    def exited(self, workflow_id: str) -> None:
        """Wake whoever waits on this workflow: it may have ended."""
        for waker in self._wakers.get(workflow_id, ()):
            waker.wake(workflow_id)

    def waited(self) -> builtins.list[str]:
        """Return the workflows someone waits on (another daemon may end them, unseen here)."""
        return builtins.list(self._wakers)

    def stop(self) -> None:
        """Answer every wait now (`unavailable`): the daemon is shutting down."""
        self._stopping = True
        for wakers in self._wakers.values():
            for waker in wakers:
                waker.event.set()

    async def wait(
        self,
        workflow_ids: Iterable[str],
        *,
        any: bool = False,
        timeout_s: float | None = None,
        until: str = "ended",
    ) -> dict[str, Any]:
        """Return once the workflows end (all, or one with `any`), or after `timeout_s`.

        With `until="blocked"`, a workflow counts once no actor runs it (it waits, is held, or
        ended), which is what `workflowctl start` reports.

        The result is `{"workflows": [...], "timed_out"}`, one entry per id in the order given:
        `{"workflow_id", "workflow", "status", "ended", "error", "result"}` (`result` only for
        an ended one).
        """
        ids = builtins.list(dict.fromkeys(workflow_ids))
        for wid in ids:
            if await self._store.get(wid) is None:
                raise WorkflowNotFound(f"no workflow {wid!r}")
        waker = _Waker(ids)
        for wid in ids:
            self._wakers.setdefault(wid, set()).add(waker)
        ended: dict[str, dict[str, Any]] = {}
        done = False
        try:
            with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
                while not done:
                    if self._stopping:
                        raise Unavailable("workflowd is shutting down")
                    waker.event = anyio.Event()  # before looking: an exit meanwhile wakes us
                    due, waker.due = waker.due, set()
                    for wid in ids:
                        if wid in due and wid not in ended and not self._running(wid):
                            row = await self._store.get(wid)
                            if row is None or row.status in _FINAL:
                                ended[wid] = self._outcome(wid, row)
                            elif until == "blocked" and not self._elsewhere(row):
                                ended[wid] = _entry(wid, row, row.status, ended=False)
                    done = bool(ended) if any else len(ended) == len(ids)
                    if not done:
                        await waker.event.wait()
        finally:
            for wid in ids:
                wakers = self._wakers.get(wid, set())
                wakers.discard(waker)
                if not wakers:
                    self._wakers.pop(wid, None)
        out = []
        for wid in ids:
            if wid in ended:
                out.append(ended[wid])
                continue
            row = await self._store.get(wid)
            status = row.status if row is not None else "Deleted"
            out.append(_entry(wid, row, status, ended=False))
        return {"workflows": out, "timed_out": not done}

    def _outcome(self, workflow_id: str, row: WorkflowRow | None) -> dict[str, Any]:
        """Describe an ended workflow, with its result: `result()` if Finished and defined."""
        if row is None:  # deleted (retention) between two looks
            return _entry(workflow_id, None, "Deleted", ended=True) | {"result": None}
        out = _entry(workflow_id, row, row.status, ended=True)
        result: Any = _json_or_text(row.data)
        cls = self._type(row.name)
        method = getattr(cls, "result", None)
        if row.status == WorkflowStatus.FINISHED.value and cls is not None and callable(method):
            try:
                result = msgspec.to_builtins(cls.from_json(row.data).result())  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - workflow code: report it, keep the data
                out["result_error"] = f"{type(e).__name__}: {e}"
        out["result"] = result
        return out


def _entry(wid: str, row: WorkflowRow | None, status: str, *, ended: bool) -> dict[str, Any]:
    return {
        "workflow_id": wid,
        "workflow": row.name if row is not None else None,
        "status": status,
        "ended": ended,
        "error": row.error if row is not None else None,
    }


def _json_or_text(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


def describe_types(registry: dict[str, type[Workflow]]) -> builtins.list[dict[str, Any]]:
    """Return each registered workflow type with its input fields: name, type, default."""
    out = []
    for name, cls in sorted(registry.items()):
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an unresolvable annotation is shown as written
            hints = {}
        fields = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            tp = hints.get(f.name, f.type)
            field: dict[str, Any] = {"name": f.name, "type": _type_name(tp), "required": False}
            if f.default is not dataclasses.MISSING:
                field["default"] = _jsonable(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                field["default"] = _jsonable(f.default_factory())
            else:
                field["required"] = True
            fields.append(field)
        doc = (cls.__doc__ or "").strip().split("\n")[0]
        out.append({"workflow": name, "doc": doc, "fields": fields})
    return out


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _jsonable(value: Any) -> Any:
    try:
        return msgspec.to_builtins(value)
    except TypeError:
        return repr(value)
