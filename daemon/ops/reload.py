"""Reload (SIGHUP, `workflowctl reload`): new settings and workflow code, if every live workflow fits."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import anyio
import msgspec
import structlog

from daemon.core.compat import Registry, blockers
from daemon.core.schedule import Schedule
from daemon.core.state import FINAL_STATUSES, State
from daemon.core.workflow import Workflow, fill_defaults
from daemon.errors import WorkflowdError
from daemon.ops.modules import import_fresh, restore, schedules_of
from daemon.runtime.cache import Cache
from daemon.runtime.settings import Settings
from daemon.service.config import Config, load_config
from daemon.service.log import set_level
from daemon.service.notify import Notifier
from daemon.store.base import Store

log = structlog.get_logger()
#: Blocking workflows listed in a reply or log record; the rest are only counted.
MAX_LISTED = 100
#: Settings read once at start; a reload that changes them says a restart is needed.
RESTART_KEYS = (
    "daemon.socket",
    "daemon.socket_mode",
    "daemon.socket_group",
    "store.path",
    "store.synchronous",
    "store.history_keep",
    "store.backend",
    "store.dsn",
    "store.passfile",
    "store.node_id",
    "store.lease_s",
    "log.format",
    "metrics.listen",
    "http.listen",
)


def settings_of(cfg: Config) -> Settings:
    """Map the `[runtime]` section onto the runtime's settings."""
    r = cfg.runtime
    return Settings(
        max_concurrent_steps=r.max_concurrent_steps,
        retry_initial_s=r.retry_initial_s,
        retry_max_s=r.retry_max_s,
        retry_max_attempts=r.retry_max_attempts,
        keep_finished_days=cfg.store.keep_finished_days,
    )


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

    def __init__(
        self,
        cfg: Config,
        *,
        store: Store,
        cache: Cache,
        running: Callable[[str], bool],
        unfit: Callable[[str], str | None],
        configure: Callable[[Registry, Settings], None],
        refit: Callable[[], Awaitable[list[dict[str, Any]]]],
        notifier: Notifier,
    ) -> None:
        self.cfg, self.notifier = cfg, notifier
        #: The config the daemon started with: what the RESTART_KEYS still run on.
        self._started = cfg
        self._store, self._cache = store, cache
        #: Tells whether a workflow's actor runs now (its object may be mid-step).
        self._running = running
        #: Says why a workflow is held for not fitting the running code: it cannot block
        #: a reload (new code is what may fix it).
        self._unfit = unfit
        #: Installs accepted code and settings in the runtime.
        self._configure = configure
        #: Releases the held workflows that fit the code just installed; returns the others.
        self._refit = refit
        #: Called with the new config once a reload is accepted (the control socket's limits).
        self.on_config: Callable[[Config], None] | None = None
        #: Called with the new code's schedules once a reload is accepted.
        self.on_schedules: Callable[[dict[str, Schedule]], None] | None = None
        self._lock = anyio.Lock()

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
        except WorkflowdError as e:
            log.error("reload_refused", error=str(e))
            return {"reloaded": False, "error": str(e), "blocked": []}
        try:
            schedules = schedules_of(cfg, registry)
        except WorkflowdError as e:
            restore(old)
            log.error("reload_refused", error=str(e))
            return {"reloaded": False, "error": str(e), "blocked": []}
        blocked: dict[str, dict[str, Any]] = {}
        async for row in self._store.unfinished():
            if self._unfit(row.id) is not None:
                continue
            try:
                state = State.from_json(row.state)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # recovery reported it, and new code cannot fix it
            if row.name in self._cache.registry or row.name in registry:
                _note(blocked, row.id, row.name, blockers(registry, row.name, row.data, state))
        # From here to the switch nothing awaits, so no workflow moves between check and switch.
        # Workflows in memory may be ahead of the rows read above: check them as they are now.
        for wid, loaded in self._cache.items():
            if loaded.state.status in FINAL_STATUSES or self._unfit(wid) is not None:
                continue
            name = loaded.state.workflow
            reasons = blockers(registry, name, loaded.wf.to_json(), loaded.state)
            new_cls = registry.get(name)
            if self._running(wid) and new_cls and not _adoptable(loaded.wf, new_cls):
                reasons.append("running now, and its object cannot switch class; retry later")
            _note(blocked, wid, name, reasons)
        if blocked:
            restore(old)
            return self._refused(list(blocked.values()))
        self._switch(registry, old)
        set_level(cfg.log.level)
        log.info("reloaded", workflows=sorted(registry))
        restart = self._apply(cfg, registry)
        try:
            still = await self._refit()
        except Exception as e:  # noqa: BLE001 - the reload is done; the next one checks again
            log.error("reload_refit_failed", error=f"{type(e).__name__}: {e}")
            still = []
        if still:
            log.warning("reload_left_incompatible", count=len(still), held=still[:MAX_LISTED])
        if self.on_schedules is not None:
            self.on_schedules(schedules)
        return {
            "reloaded": True,
            "workflows": sorted(registry),
            "needs_restart": restart,
            "incompatible": still[:MAX_LISTED],
            "incompatible_count": len(still),
        }

    def _refused(self, blocked: list[dict[str, Any]]) -> dict[str, Any]:
        error = f"{len(blocked)} live workflow(s) do not fit the new code"
        listed = blocked[:MAX_LISTED]
        for b in listed:  # one record each, so `workflowctl logs --workflow ID` shows it
            log.error("reload_blocked_by", workflow_id=b["workflow_id"], reasons=b["reasons"])
        log.error("reload_refused", error=error, blocked=listed)
        return {"reloaded": False, "error": error, "blocked": listed, "blocked_count": len(blocked)}

    def _switch(self, registry: Registry, old: dict[str, ModuleType | None]) -> None:
        """Use the new classes from now on; a workflow running now switches after its step."""
        for wid, loaded in self._cache.items():
            new_cls = registry.get(loaded.state.workflow)
            if not self._running(wid):
                self._cache.forget(wid)  # decoded with the new class when next needed
            elif new_cls is not None:
                adopt(loaded.wf, new_cls)  # its actor holds this object; a step may be in flight
            # An actor's object stays cached even if finished: the actor reads it back.
        for name in old:  # as `import` would: the package's attribute names the new module
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, sys.modules[name])

    def _apply(self, cfg: Config, registry: Registry) -> list[str]:
        self._configure(registry, settings_of(cfg))  # the new code is checked as at start
        if self.on_config is not None:
            self.on_config(cfg)
        # Against the start, not the last reload: a second reload must still say it.
        changed = [k for k in RESTART_KEYS if _get(cfg, k) != _get(self._started, k)]
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
