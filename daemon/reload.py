"""SIGHUP: re-read the config and swap in new workflow code only if every live workflow fits it."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from .config import Config, import_workflow_modules, load_config
from .engine import Definition
from .errors import WorkflowError
from .log import set_level
from .notify import Notifier
from .state import State, ThreadStatus
from .statements import For as ForStmt
from .statements import Go, Stmt, Wait, WaitFor, _Branching, children
from .statements import Step as StepStmt
from .workflow import Workflow, collect

if TYPE_CHECKING:
    from .runtime import Runtime

log = structlog.get_logger()

#: The statement kind a thread in each status must stop at.
_KIND_OF_STATUS = {
    ThreadStatus.EXECUTING: "step",
    ThreadStatus.WAITING_EVENT: "wait",
    ThreadStatus.WAITING_CONDITION: "wait_for",
}


def named_kinds(stmt: Stmt) -> dict[str, str]:
    """Map every statement name in a definition to its kind."""
    kinds: dict[str, str] = {}
    stack = [stmt]
    while stack:
        s = stack.pop()
        match s:
            case StepStmt(name=name):
                kinds[name] = "step"
            case Wait(name=name):
                kinds[name] = "wait"
            case WaitFor(name=name):
                kinds[name] = "wait_for"
            case ForStmt(name=name):
                kinds[name] = "for"
            case Go(name=name):
                kinds[name] = "go"
            case _Branching(branches=branches):
                kinds.update((b.name, "branch") for b in branches)
        stack.extend(children(s))
    return kinds


def blockers(registry: dict[str, type[Workflow]], name: str, data: str, state: State) -> list[str]:
    """Say why a live workflow could not continue under new code (empty: it can)."""
    cls = registry.get(name)
    if cls is None:
        return [f"workflow type {name!r} is gone"]
    try:
        wf = cls.from_json(data)
        root = wf.definition()
        defn = Definition(root)
    except Exception as e:  # noqa: BLE001 - any failure of the new code blocks the reload
        return [f"new code cannot load it: {type(e).__name__}: {e}"]
    kinds = named_kinds(root)
    found: list[str] = []
    for t in state.threads:
        if t.name != "_main_" and t.name not in defn.gos:
            found.append(f"thread {t.id}: Go {t.name!r} is gone")
        if not t.cur_step:
            continue
        want = _KIND_OF_STATUS.get(t.status)
        have = kinds.get(t.cur_step)
        if have is None:
            found.append(f"thread {t.id}: statement {t.cur_step!r} is gone")
        elif want is not None and have != want:
            found.append(f"thread {t.id}: {t.cur_step!r} is now a {have}, was a {want}")
        for ev in t.wait_events:
            if ev.req.name not in defn.events:
                found.append(f"thread {t.id}: event {ev.req.name!r} is gone")
    return found


class Reloader:
    """Applies a SIGHUP: new log level and retry settings, new workflow code when compatible."""

    def __init__(self, cfg: Config, rt: Runtime, notifier: Notifier) -> None:
        self.cfg, self.rt, self.notifier = cfg, rt, notifier
        self.last: dict[str, Any] = {}

    @staticmethod
    def load_registry(cfg: Config, *, fresh: bool = False) -> dict[str, type[Workflow]]:
        """Import (or with `fresh`, re-import) the workflow modules and collect their classes."""
        if fresh:
            for name in cfg.workflows.modules:
                module = sys.modules.get(name)
                if module is not None:
                    importlib.reload(module)
        return collect(import_workflow_modules(cfg))

    async def reload(self) -> dict[str, Any]:
        """Reload; returns (and logs) what happened, including what blocked new code."""
        from .main import settings_of

        self.notifier.reloading()
        try:
            result = await self._reload(settings_of)
        finally:
            self.notifier.ready()
        self.last = result
        return result

    async def _reload(self, settings_of: Any) -> dict[str, Any]:
        try:
            cfg = load_config(self.cfg.source)
            registry = self.load_registry(cfg, fresh=True)
        except WorkflowError as e:
            log.error("reload_refused", error=str(e))
            return {"ok": False, "error": str(e), "blocked": []}
        blocked: list[dict[str, Any]] = []
        async for row in self.rt.store.unfinished():
            try:
                state = State.from_json(row.state)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a corrupt row is reported by recovery, and new code cannot fix it
            reasons = blockers(registry, row.name, row.data, state)
            if reasons:
                blocked.append({"workflow_id": row.id, "workflow": row.name, "reasons": reasons})
        set_level(cfg.log.level)
        self.rt.settings = settings_of(cfg)
        if blocked:
            log.error("reload_refused", blocked=blocked)
            return {
                "ok": False,
                "error": "live workflows do not fit the new code",
                "blocked": blocked,
            }
        self.rt.registry = registry
        self.rt.cache.clear()
        self.cfg = cfg
        log.info("reloaded", workflows=sorted(registry))
        return {"ok": True, "workflows": sorted(registry), "blocked": []}
