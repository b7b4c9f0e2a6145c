"""The actor's own helpers: the check that a handler's writes fit the data fields."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from daemon.core.statements import S, Section
from daemon.core.workflow import Workflow
from daemon.errors import HandlerRejected
from daemon.runtime.actor import _check_fits


@dataclass
class Counts(Workflow):
    """Data with a typed list, for the fit check."""

    got: list[int] = field(default_factory=list)

    def definition(self) -> Section:
        return S()


class TestCheckFits:
    """A handler's writes are checked against the fields; data it left alone is not decoded."""

    def test_data_left_as_it_was_is_returned_as_json(self) -> None:
        wf = Counts(got=[1])
        assert _check_fits(wf, wf.snapshot()) == '{"got":[1]}'

    def test_a_write_that_does_not_fit_is_rejected(self) -> None:
        wf = Counts(got=[1])
        before = wf.snapshot()
        wf.got.append(1.5)  # type: ignore[arg-type]  # what a careless handler does
        with pytest.raises(HandlerRejected, match="does not fit Counts"):
            _check_fits(wf, before)

    def test_without_the_data_before_every_write_is_checked(self) -> None:
        wf = Counts(got=[1.5])  # type: ignore[list-item]
        with pytest.raises(HandlerRejected):
            _check_fits(wf)

    def test_a_write_that_fits_is_returned(self) -> None:
        wf = Counts()
        before = wf.snapshot()
        wf.got.append(2)
        assert _check_fits(wf, before) == '{"got":[2]}'
