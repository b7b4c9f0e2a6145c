"""The Workflow base class: durable data fields, JSON, and the registry of workflow types."""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Self, TypeVar

import msgspec

from daemon.core.statements import Section
from daemon.errors import BadRequest, ValidationError

_SCALARS = (str, int, float, bool, type(None))
_encoder = msgspec.json.Encoder()
T = TypeVar("T")


def check_field_type(tp: Any, where: str) -> None:
    """Raise ValidationError unless `tp` is JSON-storable (scalars, lists, str-keyed dicts, dataclasses)."""
    origin = typing.get_origin(tp)
    if tp in _SCALARS or tp is Any or tp is None:
        return
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        for name, sub in typing.get_type_hints(tp).items():
            check_field_type(sub, f"{where}.{name}")
        return
    if tp is list or origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        check_field_type(item, f"{where}[]")
        return
    if tp is dict or origin is dict:
        key, value = typing.get_args(tp) or (str, Any)
        if key is not str:
            raise ValidationError(f"{where}: dict keys must be str, not {key!r}")
        check_field_type(value, f"{where}[]")
        return
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            check_field_type(arg, where)
        return
    if origin is typing.Literal and all(isinstance(a, _SCALARS) for a in typing.get_args(tp)):
        return
    raise ValidationError(
        f"{where}: type {tp!r} cannot be stored; use str, int, float, bool, None, "
        "list, dict[str, ...] or a dataclass of those"
    )


def fill_defaults(obj: T) -> T:
    """Store every defaulted field on the instance (msgspec leaves class defaults implicit).

    Without this, a field still at its default would not be written to the store, and a later
    change of the default in code would silently change running workflows.
    """
    # Runs on every load of a workflow: scalars are skipped without a call, and each
    # dataclass's field names are looked up once per class.
    tp = type(obj)
    if tp in _SCALAR_TYPES:
        return obj
    names = _field_names.get(tp, _UNSEEN)
    if names is _UNSEEN:
        names = _remember_fields(tp)
    if names is None:
        if isinstance(obj, list):
            items: Iterable[Any] = obj
        elif isinstance(obj, dict):
            items = obj.values()
        else:
            return obj
        for item in items:
            if type(item) not in _SCALAR_TYPES:
                fill_defaults(item)
        return obj
    attrs = getattr(obj, "__dict__", None)  # None for slots classes, which always set all
    for name in names:
        value = getattr(obj, name)
        if type(value) not in _SCALAR_TYPES:
            fill_defaults(value)
        if attrs is not None and name not in attrs:
            setattr(obj, name, value)
    return obj


_SCALAR_TYPES = frozenset(_SCALARS)
_UNSEEN: Any = object()
#: The data field names of each dataclass type met by `fill_defaults` (None: not one).
_field_names: dict[type, tuple[str, ...] | None] = {}
#: One typed decoder per workflow class (`msgspec.json.decode(type=)` looks the type up each call).
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
#: Reloads make new classes; the caches are dropped whole past this many, not kept forever.
_CACHED_TYPES = 4096


def _remember_fields(tp: type) -> tuple[str, ...] | None:
    if len(_field_names) >= _CACHED_TYPES:
        _field_names.clear()
    names = tuple(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else None
    _field_names[tp] = names
    return names


def _decoder(cls: type[T]) -> msgspec.json.Decoder[T]:
    decoder = _decoders.get(cls)
    if decoder is None:
        if len(_decoders) >= _CACHED_TYPES:
            _decoders.clear()
        decoder = _decoders[cls] = msgspec.json.Decoder(cls)
    return decoder


def _check_fields(cls: type) -> None:
    for name, tp in typing.get_type_hints(cls).items():
        if typing.get_origin(tp) is ClassVar or tp is ClassVar:
            continue
        if name in _RESERVED:
            raise ValidationError(
                f"{cls.__name__}.{name}: a data field may not be called {name!r}, "
                "it would hide Workflow's own attribute of that name"
            )
        check_field_type(tp, f"{cls.__name__}.{name}")


class Workflow:
    """Base class of workflows: `@dataclass class X(Workflow)` with a `definition()`."""

    #: The name workflows of this class are registered and started under.
    name: ClassVar[str] = "Workflow"
    #: An argv template run when a workflow of this type fails (or finishes), instead of the
    #: `[hooks]` one; `[]` runs none. None: the `[hooks]` one.
    on_failure: ClassVar[Sequence[str] | None] = None
    on_finish: ClassVar[Sequence[str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__
        # A forward reference to a class not defined yet is checked again in collect().
        with contextlib.suppress(NameError):
            _check_fields(cls)

    def definition(self) -> Section:
        """Build the statement tree from the current data."""
        raise NotImplementedError(f"{type(self).__name__} must define definition()")

    def to_json(self) -> str:
        """Serialize the data fields to JSON text."""
        return _encoder.encode(self).decode()

    @classmethod
    def from_json(cls, s: str | bytes) -> Self:
        """Rebuild a workflow from JSON text produced by `to_json`."""
        return fill_defaults(_decoder(cls).decode(s))

    @classmethod
    def from_input(cls, data: dict[str, Any] | None) -> Self:
        """Build a new workflow from a start request's input (field name -> value)."""
        data = data or {}
        if not isinstance(data, dict):
            raise BadRequest(f"input for {cls.name} must be an object of field values")
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise BadRequest(
                f"{cls.name} has no field {', '.join(unknown)}; fields: {', '.join(sorted(known))}"
            )
        try:
            return fill_defaults(msgspec.convert(data, type=cls))
        except msgspec.ValidationError as e:
            raise BadRequest(f"input for {cls.name}: {e}") from e

    def snapshot(self) -> bytes:
        """Capture the data (used to undo a handler that raised)."""
        return _encoder.encode(self)

    def restore(self, snap: bytes) -> None:
        """Put back data captured by `snapshot`."""
        fresh = _decoder(type(self)).decode(snap)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, getattr(fresh, f.name))


def timeout_of(cls: type[Workflow]) -> float | None:
    """Return the class's `timeout_s` (a whole-workflow deadline in seconds), or None.

    A data field called `timeout_s` is data, not a deadline: only a plain class attribute
    (`timeout_s = 3600`, no annotation) sets one.
    """
    value = getattr(cls, "timeout_s", None)
    if value is None or not dataclasses.is_dataclass(cls):
        return None
    if "timeout_s" in {f.name for f in dataclasses.fields(cls)}:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValidationError(f"{cls.__name__}.timeout_s must be seconds > 0, not {value!r}")
    return float(value)


def collect(modules: Iterable[types.ModuleType]) -> dict[str, type[Workflow]]:
    """Return every Workflow subclass defined in `modules`, keyed by its name."""
    found: dict[str, type[Workflow]] = {}
    for module in modules:
        for obj in vars(module).values():
            if not (isinstance(obj, type) and issubclass(obj, Workflow) and obj is not Workflow):
                continue
            if obj.__module__ != module.__name__:
                continue
            if not dataclasses.is_dataclass(obj):
                raise ValidationError(f"workflow {obj.__qualname__} must be a @dataclass")
            try:
                _check_fields(obj)
            except NameError as e:
                raise ValidationError(
                    f"workflow {obj.__qualname__}: unknown field type: {e}"
                ) from e
            other = found.get(obj.name)
            if other is not None and other is not obj:
                raise ValidationError(
                    f"two workflows are named {obj.name!r}: "
                    f"{other.__module__}.{other.__qualname__} and {module.__name__}.{obj.__qualname__}"
                )
            found[obj.name] = obj
    return found


#: Workflow's own attributes, which a data field must not hide.
_RESERVED = frozenset(n for n in vars(Workflow) if not n.startswith("_"))
