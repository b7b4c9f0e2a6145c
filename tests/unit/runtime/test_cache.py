"""The Definition a cached workflow keeps between callbacks, and when it no longer counts."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.core.definition import Definition
from daemon.core.state import State
from daemon.runtime.cache import Loaded
from tests.workflows.callbacks import BumpCounter


@dataclass
class BumpCounterV2(BumpCounter):
    """The same workflow as new code a reload switches a live object to."""


def _loaded() -> Loaded:
    wf = BumpCounter()
    return Loaded(wf, State.new("w", "BumpCounter"))


def test_a_kept_definition_is_returned_for_the_same_object() -> None:
    loaded = _loaded()
    defn = Definition(loaded.wf.definition())
    loaded.keep(defn)
    assert loaded.definition() is defn
    loaded.keep(None)
    assert loaded.definition() is None


def test_a_replaced_object_or_a_switched_class_drops_it() -> None:
    loaded = _loaded()
    loaded.keep(Definition(loaded.wf.definition()))
    loaded.wf.__class__ = BumpCounterV2  # as a reload's adopt does
    assert loaded.definition() is None
    loaded.keep(Definition(loaded.wf.definition()))
    loaded.wf = BumpCounter()  # as a repair does
    assert loaded.definition() is None
