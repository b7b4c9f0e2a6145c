"""Importing the operator's workflow modules: at start, and anew beside the live ones on reload."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from daemon.core.schedule import Schedule
from daemon.core.workflow import Workflow, collect
from daemon.errors import BadRequest, ConfigError, ValidationError
from daemon.service.config import Config

Registry = dict[str, type[Workflow]]


def load_registry(cfg: Config) -> Registry:
    """Import the workflow modules (at start) and collect their classes."""
    return collect(import_workflow_modules(cfg))


def _add_paths(cfg: Config) -> None:
    for p in reversed(cfg.workflows.paths):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _refusal(name: str, e: Exception) -> ConfigError:
    reason = " ".join(f"{type(e).__name__}: {e}".split())
    return ConfigError(f"[workflows] modules: cannot import {name!r}: {reason}")


def import_workflow_modules(cfg: Config) -> list[ModuleType]:
    """Put [workflows] paths on sys.path and import every listed module."""
    _add_paths(cfg)
    modules = []
    for name in cfg.workflows.modules:
        try:
            modules.append(importlib.import_module(name))
        except Exception as e:  # any error in user code is a config problem here
            raise _refusal(name, e) from e
    return modules


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
    _add_paths(cfg)
    importlib.invalidate_caches()
    old = {name: sys.modules.pop(name, None) for name in cfg.workflows.modules}
    name = ""
    try:
        modules = []
        for name in cfg.workflows.modules:  # a loop, not a comprehension: `name` names the culprit
            modules.append(_exec_fresh(name))
        return collect(modules), old
    except Exception as e:  # any error in user code refuses the reload
        restore(old)
        raise _refusal(name, e) from e


def restore(old: dict[str, ModuleType | None]) -> None:
    """Put back the modules `import_fresh` replaced."""
    for name, module in old.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def schedules_of(cfg: Config, registry: Registry) -> dict[str, Schedule]:
    """Collect the module-level `Schedule`s of the imported workflow modules, checked.

    Reads the modules imported now under the configured names: at start the ones
    `load_registry` imported, on reload the fresh ones of `import_fresh`. A duplicate name, an
    unknown workflow type or an input the type refuses raises ValidationError naming it.
    """
    found: dict[str, tuple[Schedule, str]] = {}
    for module_name in cfg.workflows.modules:
        module = sys.modules.get(module_name)
        for obj in vars(module).values() if module is not None else ():
            if not isinstance(obj, Schedule):
                continue
            seen = found.get(obj.name)
            if seen is not None and seen[0] is not obj:
                raise ValidationError(
                    f"two schedules are named {obj.name!r}: in {seen[1]} and {module_name}"
                )
            cls = registry.get(obj.workflow)
            if cls is None:
                known = ", ".join(sorted(registry)) or "none"
                raise ValidationError(
                    f"schedule {obj.name!r}: no workflow type {obj.workflow!r} (known: {known})"
                )
            try:
                cls.from_input(obj.input)
            except BadRequest as e:
                raise ValidationError(f"schedule {obj.name!r}: {e}") from None
            found.setdefault(obj.name, (obj, module_name))
    return {name: s for name, (s, _) in found.items()}
