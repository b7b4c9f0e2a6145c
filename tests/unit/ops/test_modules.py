"""Collecting the module-level Schedules of the workflow modules, checked against the registry."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon import Schedule, ValidationError
from daemon.ops.modules import schedules_of
from daemon.service.config import (
    Config,
    DaemonConfig,
    LogConfig,
    RuntimeConfig,
    StoreConfig,
    WorkflowsConfig,
)
from tests.workflows.schedules import Chime

REGISTRY: dict[str, Any] = {"Chime": Chime}


@pytest.fixture
def modules() -> Iterator[dict[str, types.ModuleType]]:
    """Two throwaway modules registered in sys.modules, removed afterwards."""
    made = {name: types.ModuleType(name) for name in ("sched_one", "sched_two")}
    sys.modules.update(made)
    yield made
    for name in made:
        sys.modules.pop(name, None)


def config(*modules: str) -> Config:
    """A config naming `modules` in [workflows] modules."""
    return Config(
        source=Path("config.toml"),
        daemon=DaemonConfig(),
        store=StoreConfig(),
        workflows=WorkflowsConfig(modules=modules),
        runtime=RuntimeConfig(),
        log=LogConfig(),
    )


class TestSchedulesOf:
    """schedules_of()."""

    def test_collects_module_level_schedules(self, modules: dict[str, types.ModuleType]) -> None:
        """Every Schedule object at module level is found, keyed by its name."""
        a, b = Schedule("a", "Chime", every=5), Schedule("b", "Chime", cron="0 3 * * *")
        modules["sched_one"].a, modules["sched_two"].b = a, b  # type: ignore[attr-defined]
        modules["sched_two"].not_one = "a"  # type: ignore[attr-defined]
        assert schedules_of(config("sched_one", "sched_two"), REGISTRY) == {"a": a, "b": b}

    def test_the_same_object_imported_twice_is_one(
        self, modules: dict[str, types.ModuleType]
    ) -> None:
        """`from sched_one import a` in another module is not a duplicate."""
        a = Schedule("a", "Chime", every=5)
        modules["sched_one"].a = modules["sched_two"].a = a  # type: ignore[attr-defined]
        assert schedules_of(config("sched_one", "sched_two"), REGISTRY) == {"a": a}

    def test_duplicate_names(self, modules: dict[str, types.ModuleType]) -> None:
        """Two schedules with one name are refused, naming both modules."""
        modules["sched_one"].a = Schedule("twin", "Chime", every=5)  # type: ignore[attr-defined]
        modules["sched_two"].b = Schedule("twin", "Chime", every=6)  # type: ignore[attr-defined]
        with pytest.raises(ValidationError, match="'twin': in sched_one and sched_two"):
            schedules_of(config("sched_one", "sched_two"), REGISTRY)

    def test_unknown_workflow_type(self, modules: dict[str, types.ModuleType]) -> None:
        """A schedule of a type no module registers is refused, naming both."""
        modules["sched_one"].a = Schedule("orphan", "Nope", every=5)  # type: ignore[attr-defined]
        with pytest.raises(ValidationError, match="'orphan': no workflow type 'Nope'"):
            schedules_of(config("sched_one"), REGISTRY)

    def test_input_the_type_refuses(self, modules: dict[str, types.ModuleType]) -> None:
        """The input is checked against the workflow's fields."""
        bad = Schedule("typo", "Chime", every=5, input={"lable": "x"})
        modules["sched_one"].a = bad  # type: ignore[attr-defined]
        with pytest.raises(ValidationError, match="'typo': Chime has no field lable"):
            schedules_of(config("sched_one"), REGISTRY)
