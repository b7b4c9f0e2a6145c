"""Tests for the Workflow base class: JSON, field checks, names, the registry and snapshots."""

from __future__ import annotations

import dataclasses
import datetime
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec
import pytest

import daemon
from daemon import S, Section, Step, ValidationError, Workflow
from daemon.core.workflow import collect
from daemon.errors import BadRequest
from tests.helpers import REPO


@dataclass
class Address:
    """A nested record."""

    city: str = ""
    zip: str | None = None


@dataclass
class Person:
    """A record nesting another record and a list of them."""

    name: str = ""
    home: Address = field(default_factory=Address)
    previous: list[Address] = field(default_factory=list)


@dataclass
class Dated:
    """A record with a field that cannot be stored."""

    when: datetime.date


class NotADataclass:
    """A plain class: its instances cannot be stored as JSON."""


@dataclass
class Rich(Workflow):
    """A workflow using every supported kind of field."""

    count: int = 0
    ratio: float = 0.5
    ok: bool = False
    label: str = ""
    maybe: int | None = None
    tags: list[str] = field(default_factory=list)
    scores: dict[str, list[int]] = field(default_factory=dict)
    owner: Person = field(default_factory=Person)
    backup: Person | None = None
    mode: Literal["fast", "slow"] = "fast"
    anything: Any = None
    loose: list = field(default_factory=list)  # type: ignore[type-arg]
    kinds: ClassVar[tuple[str, ...]] = ("ignored", "class", "var")

    def definition(self) -> Section:
        return S(Step("noop", lambda: None))


class TestCanary:
    """The `daemon` import name is ours, not PyPI's python-daemon."""

    def test_import_daemon_is_this_repo(self) -> None:
        """`daemon` resolves to this checkout's package and exports Workflow."""
        assert Path(daemon.__file__ or "").resolve().parent == REPO / "daemon"
        assert daemon.Workflow is Workflow


class TestJson:
    """Workflow data survives a JSON round trip."""

    def test_round_trip_nested(self) -> None:
        """Nested dataclasses, lists, dicts and optionals come back equal and typed."""
        wf = Rich(
            count=3,
            ratio=1.25,
            ok=True,
            label="x",
            maybe=7,
            tags=["a", "b"],
            scores={"p": [1, 2], "q": []},
            owner=Person("ann", Address("Oslo", "0150"), [Address("Rome")]),
            backup=Person("bob"),
            mode="slow",
            anything={"free": [1, "form"]},
            loose=[1, "two"],
        )
        back = Rich.from_json(wf.to_json())
        assert back == wf
        assert isinstance(back.owner.home, Address)
        assert isinstance(back.owner.previous[0], Address)
        assert isinstance(back.backup, Person)

    def test_round_trip_defaults_and_none(self) -> None:
        """Defaults and None optionals round-trip too."""
        wf = Rich()
        assert Rich.from_json(wf.to_json()) == wf

    def test_class_vars_and_name_not_stored(self) -> None:
        """Only data fields are serialized, not ClassVars such as `name`."""
        stored = msgspec.json.decode(Rich().to_json())
        assert set(stored) == {f.name for f in dataclasses.fields(Rich)}
        assert "kinds" not in stored
        assert "name" not in stored


class TestFieldTypes:
    """A field that cannot be stored is rejected when the class statement runs."""

    @pytest.mark.parametrize(
        ("annotation", "message"),
        [
            ("set[int]", "Bad.field: type set"),
            ("tuple[int, int]", "Bad.field: type tuple"),
            ("datetime.datetime", "Bad.field: type <class 'datetime.datetime'>"),
            ("NotADataclass", "Bad.field: type <class .*NotADataclass"),
            ("dict[int, str]", "Bad.field: dict keys must be str"),
            ("list[set[str]]", r"Bad.field\[\]: type set"),
            ("Person | set[int]", "Bad.field: type set"),
        ],
    )
    def test_unsupported_type_raises_at_class_definition(
        self, annotation: str, message: str
    ) -> None:
        """The `@dataclass class X(Workflow)` statement itself raises ValidationError."""
        source = f"@dataclass\nclass Bad(Workflow):\n    field: {annotation} = None\n"
        with pytest.raises(ValidationError, match=message):
            exec(source, globals(), {})  # noqa: S102 - the class statement itself must raise

    def test_unsupported_type_in_nested_dataclass(self) -> None:
        """A bad field inside a nested dataclass is named by its path."""

        with pytest.raises(
            ValidationError, match=r"Outer.inner.when: type <class 'datetime.date'>"
        ):

            @dataclass
            class Outer(Workflow):
                inner: Dated

    def test_supported_types_accepted(self) -> None:
        """Every supported kind of field is accepted (Rich was defined at import time)."""
        assert Rich.name == "Rich"


class TestName:
    """A workflow's registered name."""

    def test_defaults_to_class_name(self) -> None:
        """Without `name`, the class name is used."""

        @dataclass
        class Payroll(Workflow):
            pass

        assert Payroll.name == "Payroll"

    def test_can_be_overridden(self) -> None:
        """A `name` class attribute wins, and a subclass gets its own default."""

        @dataclass
        class Named(Workflow):
            name: ClassVar[str] = "custom-name"

        @dataclass
        class Child(Named):
            pass

        assert Named.name == "custom-name"
        assert Child.name == "Child"


def _module(mp: pytest.MonkeyPatch, name: str, *classes: type) -> types.ModuleType:
    """Build and register a module holding `classes`, as if they were defined in it."""
    mod = types.ModuleType(name)
    # Field annotations are strings (PEP 563), resolved in the defining module's globals.
    mod.ClassVar = ClassVar  # type: ignore[attr-defined]
    mp.setitem(sys.modules, name, mod)
    for cls in classes:
        cls.__module__ = name
        setattr(mod, cls.__name__, cls)
    return mod


class TestCollect:
    """`collect` finds the workflows defined in modules."""

    def test_finds_workflows_of_the_module_only(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Workflows defined in the module are found; imported ones and non-workflows are not."""

        @dataclass
        class One(Workflow):
            pass

        @dataclass
        class Two(Workflow):
            name: ClassVar[str] = "second"

        mod = _module(monkeypatch, "wfs_a", One, Two)
        mod.Rich = Rich  # type: ignore[attr-defined]  # imported from elsewhere
        mod.Address = Address  # type: ignore[attr-defined]
        mod.Workflow = Workflow  # type: ignore[attr-defined]
        assert collect([mod]) == {"One": One, "second": Two}

    def test_duplicate_names_rejected(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Two workflows registered under one name fail, naming both classes."""

        @dataclass
        class Dup(Workflow):
            pass

        @dataclass
        class Other(Workflow):
            name: ClassVar[str] = "Dup"

        with pytest.raises(ValidationError, match=r"two workflows are named 'Dup'.*wfs_b.*wfs_c"):
            collect([_module(monkeypatch, "wfs_b", Dup), _module(monkeypatch, "wfs_c", Other)])

    def test_same_module_twice_is_fine(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Listing a module twice does not count as a duplicate."""

        @dataclass
        class Once(Workflow):
            pass

        mod = _module(monkeypatch, "wfs_d", Once)
        assert collect([mod, mod]) == {"Once": Once}

    def test_not_a_dataclass_rejected(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A Workflow subclass without @dataclass is rejected."""

        class Plain(Workflow):
            pass

        with pytest.raises(ValidationError, match="must be a @dataclass"):
            collect([_module(monkeypatch, "wfs_e", Plain)])

    def test_unresolvable_field_type_rejected(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A field type that never resolves is a ValidationError, not a NameError."""

        @dataclass
        class Dangling(Workflow):
            x: NoSuchType  # type: ignore[name-defined]  # noqa: F821

        with pytest.raises(ValidationError, match="NoSuchType"):
            collect([_module(monkeypatch, "wfs_f", Dangling)])


class TestFromInput:
    """`from_input` builds a workflow from a start request's input."""

    def test_builds_typed_workflow(self) -> None:
        """Nested values are converted to their dataclasses; missing fields take defaults."""
        wf = Rich.from_input({"count": 2, "owner": {"name": "ann", "home": {"city": "Oslo"}}})
        assert wf.count == 2
        assert wf.owner == Person("ann", Address("Oslo"))
        assert wf.tags == []

    def test_none_means_defaults(self) -> None:
        """No input builds the default workflow."""
        assert Rich.from_input(None) == Rich()

    def test_unknown_fields_named(self) -> None:
        """Unknown fields are rejected, naming them and the known ones."""
        with pytest.raises(BadRequest, match=r"Rich has no field bogus, zzz; fields: .*count"):
            Rich.from_input({"bogus": 1, "zzz": 2, "count": 1})

    @pytest.mark.parametrize(
        ("data", "where"),
        [
            ({"count": "three"}, r"\$\.count"),
            ({"tags": [1]}, r"\$\.tags\[0\]"),
            ({"owner": {"home": {"city": 5}}}, r"\$\.owner\.home\.city"),
            ({"mode": "medium"}, r"\$\.mode"),
        ],
    )
    def test_wrong_types_named(self, data: dict[str, Any], where: str) -> None:
        """A value of the wrong type is rejected with a message naming its path."""
        with pytest.raises(BadRequest, match=rf"input for Rich: .*{where}"):
            Rich.from_input(data)

    def test_not_an_object(self) -> None:
        """Input that is not an object is rejected."""
        with pytest.raises(BadRequest, match="object of field values"):
            Rich.from_input([1, 2])  # type: ignore[arg-type]


class TestSnapshot:
    """`snapshot`/`restore` undo changes to the data."""

    def test_restore_undoes_changes_in_place(self) -> None:
        """Restoring puts back every field, nested ones included, on the same object."""
        wf = Rich(count=1, tags=["a"], owner=Person("ann"))
        before = wf.to_json()
        snap = wf.snapshot()
        wf.count = 99
        wf.tags.append("b")
        wf.owner.home.city = "Paris"
        wf.backup = Person("eve")
        same = wf
        wf.restore(snap)
        assert wf is same
        assert wf.to_json() == before

    def test_snapshot_is_independent(self) -> None:
        """A snapshot does not change when the data changes after it."""
        wf = Rich(tags=["a"])
        snap = wf.snapshot()
        wf.tags.append("b")
        assert snap == Rich(tags=["a"]).snapshot()
