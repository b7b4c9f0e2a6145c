"""Reload (SIGHUP, `workflowctl reload`): new settings and workflow code, if every live workflow fits."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from daemon.core.engine import Definition
from daemon.core.lint import log_findings
from daemon.core.state import FINAL_STATUSES, State, ThreadStatus
from daemon.core.statements import For as ForStmt
from daemon.core.statements import Go, Stmt, Wait, WaitFor, _Branching, children
from daemon.core.statements import Step as StepStmt
from daemon.core.workflow import Workflow, collect, fill_defaults
from daemon.errors import ConfigError, WorkflowError
from daemon.service.config import Config, import_workflow_modules, load_config
from daemon.service.log import set_level
from daemon.service.notify import Notifier

if TYPE_CHECKING:
    from daemon.runtime.runtime import Runtime, Settings

log = structlog.get_logger()
Registry = dict[str, type[Workflow]]
#: Blocking workflows listed in a reply or log record; the rest are only counted.
MAX_LISTED = 100
#: The statement kind a thread in each status must stop at.
_KIND_OF_STATUS = {
    ThreadStatus.EXECUTING: "step",
    ThreadStatus.WAITING_EVENT: "wait",
    ThreadStatus.WAITING_CONDITION: "wait_for",
}
#: Settings read once at start; a reload that changes them says a restart is needed.
RESTART_KEYS = (
    "daemon.socket",
    "daemon.socket_mode",
    "store.path",
    "store.synchronous",
    "store.history_keep",
    "log.format",
)


def settings_of(cfg: Config) -> Settings:
    """Map the `[runtime]` section onto the runtime's settings."""
    from daemon.runtime.runtime import Settings

    r = cfg.runtime
    return Settings(
        max_concurrent_steps=r.max_concurrent_steps,
        retry_initial_s=r.retry_initial_s,
        retry_max_s=r.retry_max_s,
        retry_max_attempts=r.retry_max_attempts,
        keep_finished_days=cfg.store.keep_finished_days,
    )


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


def blockers(registry: Registry, name: str, data: str, state: State) -> list[str]:
    """Say why a live workflow could not continue under new code (empty: it can)."""
    cls = registry.get(name)
    if cls is None:
        return [f"workflow type {name!r} is gone"]
    try:
        root = cls.from_json(data).definition()
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
        want, have = _KIND_OF_STATUS.get(t.status), kinds.get(t.cur_step)
        if have is None:
            found.append(f"thread {t.id}: statement {t.cur_step!r} is gone")
        elif want is not None and have != want:
            found.append(f"thread {t.id}: {t.cur_step!r} is now a {have}, was a {want}")
        found += [
            f"thread {t.id}: event {ev.req.name!r} is gone"
            for ev in t.wait_events
            if ev.req.name not in defn.events
        ]
    return found


def _exec_fresh(name: str) -> ModuleType:
    """Execute a module's current source into a new module object registered as `name`."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and type hints look the module up while it runs
    get_source = getattr(spec.loader, "get_source", None)
    source = get_source(name) if get_source is not None and spec.origin else None
    if source is None:
        spec.loader.exec_module(module)
    else:
        # From source, not __pycache__: bytecode is keyed on the file's mtime in whole seconds
        # and its size, so an edit of the same length within a second would load the old code.
        code = compile(source, spec.origin or name, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - the operator's own module, as import runs it
    return module


def import_fresh(cfg: Config) -> tuple[Registry, dict[str, ModuleType | None]]:
    """Import the workflow modules anew beside the live ones; return their classes and the old modules.

    The old modules are not reloaded in place: if the reload is refused, the old classes go on
    running and must keep their own module globals. Put the old ones back with `restore`.
    """
    for p in reversed(cfg.workflows.paths):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    importlib.invalidate_caches()
    old = {name: sys.modules.pop(name, None) for name in cfg.workflows.modules}
    name = ""
    try:
        modules = [_exec_fresh(name) for name in cfg.workflows.modules]
        return collect(modules), old
    except Exception as e:  # any error in user code refuses the reload
        restore(old)
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConfigError(f"[workflows] modules: cannot import {name!r}: {reason}") from e


def restore(old: dict[str, ModuleType | None]) -> None:
    """Put back the modules `import_fresh` replaced."""
    for name, module in old.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def adopt(wf: Workflow, cls: type[Workflow]) -> None:
    """Switch a live workflow object to its new class in place, so a running step keeps `self`."""
    wf.__class__ = cls
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not hasattr(wf, f.name) and f.default_factory is not dataclasses.MISSING:
            setattr(wf, f.name, f.default_factory())
    fill_defaults(wf)


def _adoptable(wf: Workflow, cls: type[Workflow]) -> bool:
    old = wf.__class__
    try:
        wf.__class__ = cls
    except TypeError:  # e.g. slots of another layout
        return False
    wf.__class__ = old
    return True


class Reloader:
    """Applies a reload: log level, runtime and control-socket limits, and compatible new code."""

    def __init__(self, cfg: Config, rt: Runtime, notifier: Notifier) -> None:
        self.cfg, self.rt, self.notifier = cfg, rt, notifier
        #: Called with the new config once a reload is accepted (the control socket's limits).
        self.on_config: Callable[[Config], None] | None = None
        self._lock = anyio.Lock()

    @staticmethod
    def load_registry(cfg: Config) -> Registry:
        """Import the workflow modules (at start) and collect their classes."""
        return collect(import_workflow_modules(cfg))

    async def reload(self) -> dict[str, Any]:
        """Reload; returns (and logs) what happened, naming the workflows that blocked it."""
        async with self._lock:  # a SIGHUP and a `workflowctl reload` may come together
            self.notifier.reloading()
            try:
                return await self._reload()
            finally:
                self.notifier.ready()

    async def _reload(self) -> dict[str, Any]:
        try:
            cfg = load_config(self.cfg.source)
            registry, old = import_fresh(cfg)
        except WorkflowError as e:
            log.error("reload_refused", error=str(e))
            return {"reloaded": False, "error": str(e), "blocked": []}
        blocked: dict[str, dict[str, Any]] = {}
        async for row in self.rt.store.unfinished():
            try:
                state = State.from_json(row.state)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # recovery reported it, and new code cannot fix it
            if row.name in self.rt.registry or row.name in registry:
                _note(blocked, row.id, row.name, blockers(registry, row.name, row.data, state))
        # From here to the switch nothing awaits, so no workflow moves between check and switch.
        # Workflows in memory may be ahead of the rows read above: check them as they are now.
        for wid, loaded in list(self.rt.cache.items()):
            if loaded.state.status in FINAL_STATUSES:
                continue
            name = loaded.state.workflow
            reasons = blockers(registry, name, loaded.wf.to_json(), loaded.state)
            new_cls = registry.get(name)
            if wid in self.rt.actors and new_cls and not _adoptable(loaded.wf, new_cls):
                reasons.append("running now, and its object cannot switch class; retry later")
            _note(blocked, wid, name, reasons)
        if blocked:
            restore(old)
            return self._refused(list(blocked.values()))
        self._switch(registry, old)
        restart = self._apply(cfg)
        log.info("reloaded", workflows=sorted(registry))
        log_findings(registry)  # the new code is checked as the code at start is
        return {"reloaded": True, "workflows": sorted(registry), "needs_restart": restart}

    def _refused(self, blocked: list[dict[str, Any]]) -> dict[str, Any]:
        error = f"{len(blocked)} live workflow(s) do not fit the new code"
        listed = blocked[:MAX_LISTED]
        for b in listed:  # one record each, so `workflowctl logs --workflow ID` shows it
            log.error("reload_blocked_by", workflow_id=b["workflow_id"], reasons=b["reasons"])
        log.error("reload_refused", error=error, blocked=listed)
        return {"reloaded": False, "error": error, "blocked": listed, "blocked_count": len(blocked)}

    def _switch(self, registry: Registry, old: dict[str, ModuleType | None]) -> None:
        """Use the new classes from now on; a workflow running now switches after its step."""
        for wid, loaded in list(self.rt.cache.items()):
            new_cls = registry.get(loaded.state.workflow)
            if wid not in self.rt.actors:
                self.rt.forget(wid)  # decoded with the new class when next needed
            elif new_cls is not None:
                adopt(loaded.wf, new_cls)  # its actor holds this object; a step may be in flight
            # An actor's object stays cached even if finished: the actor reads it back.
        self.rt.registry = registry
        for name in old:  # as `import` would: the package's attribute names the new module
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, sys.modules[name])

    def _apply(self, cfg: Config) -> list[str]:
        set_level(cfg.log.level)
        self.rt.settings = dataclasses.replace(
            settings_of(cfg), cache_size=self.rt.settings.cache_size
        )
        self.rt.limiter.total_tokens = cfg.runtime.max_concurrent_steps
        if self.on_config is not None:
            self.on_config(cfg)
        changed = [k for k in RESTART_KEYS if _get(cfg, k) != _get(self.cfg, k)]
        if changed:
            log.warning("reload_needs_restart", keys=changed)
        self.cfg = cfg
        return changed


def _note(blocked: dict[str, dict[str, Any]], wid: str, name: str, reasons: list[str]) -> None:
    blocked.pop(wid, None)
    if reasons:
        blocked[wid] = {"workflow_id": wid, "workflow": name, "reasons": reasons}


def _get(cfg: Config, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)
