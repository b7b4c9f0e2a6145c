"""Signal: a Wait case fired by a local program through the control socket."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, is_typeddict

import msgspec
import msgspec.inspect

from daemon.core.handler import CallbackRequest
from daemon.errors import HandlerRejected


class Signal:
    """Hands the callback input to `fn` and replies with what it returns.

    With `fn=None` the event carries no data and the reply is None. When `fn`'s
    one parameter is annotated with a dataclass, a TypedDict or a msgspec
    Struct, the input is converted to that type first and a mismatch is
    rejected (HandlerRejected) before `fn` runs. `fn` may be a coroutine
    function; if it raises, the engine restores the data and rejects the event.
    """

    type = "signal"
    #: Setup arms nothing outside the workflow (daemon.core.engine.QUIET_SETUP).
    quiet_setup = True

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        self.fn = fn

    async def setup(self, req: CallbackRequest) -> str:
        """Arm nothing: the event arrives over the control socket."""
        return ""

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Validate the input against `fn`'s annotation, call `fn` and return its result."""
        if self.fn is None:
            return None
        takes_input, annotation = _parameter_of(self.fn)
        result = self.fn(_convert(input, annotation)) if takes_input else self.fn()
        if inspect.isawaitable(result):
            result = await result
        return result

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Release nothing: setup armed nothing."""


def _parameter_of(fn: Callable[..., Any]) -> tuple[bool, Any]:
    """Return whether `fn` takes the input, and its annotation (cached: it runs per callback)."""
    func = getattr(fn, "__func__", None)  # a bound method is made anew on every definition()
    try:
        return _parameter(func, True) if func is not None else _parameter(fn, False)
    except TypeError:  # an unhashable callable object: not cached
        return _parameter.__wrapped__(fn, False)


@functools.lru_cache(maxsize=4096)
def _parameter(fn: Callable[..., Any], bound: bool) -> tuple[bool, Any]:
    params = list(inspect.signature(fn).parameters.values())[1 if bound else 0 :]
    if not params:
        return False, None
    return True, _annotation(fn, params[0].name)


def _annotation(fn: Callable[..., Any], name: str) -> Any:
    """Return the resolved annotation of `fn`'s parameter `name`, or None."""
    target = fn if inspect.isroutine(fn) else type(fn).__call__
    return typing.get_type_hints(target).get(name)


def _is_record(tp: Any) -> bool:
    """Tell whether `tp` is a type whose fields the input must match."""
    if not isinstance(tp, type):
        return False
    return dataclasses.is_dataclass(tp) or is_typeddict(tp) or issubclass(tp, msgspec.Struct)


def _convert(input: Any, tp: Any) -> Any:
    """Convert `input` to `fn`'s annotation `tp` (a record, or a plain type such as int)."""
    if tp is None or tp is Any or tp is object:
        return input
    try:
        return msgspec.convert(input, type=tp)
    except msgspec.ValidationError as e:
        if _is_record(tp):
            raise HandlerRejected(f"{e}; expected {tp.__name__} {_fields(tp)}") from e
        raise HandlerRejected(f"{e}; expected {_type_name(tp)}") from e
    except TypeError:
        return input  # an annotation msgspec cannot check (a plain class): pass it through


def _fields(tp: type) -> str:
    """Describe the fields of a record type: `{a: int, b?: str}` (`?` marks optional ones)."""
    hints = typing.get_type_hints(tp)
    info = msgspec.inspect.type_info(tp)
    required = {f.name for f in getattr(info, "fields", ()) if f.required}
    parts = [f"{n}{'' if n in required else '?'}: {_type_name(t)}" for n, t in hints.items()]
    return "{" + ", ".join(parts) + "}"


def _type_name(tp: Any) -> str:
    """Return a short readable name for a type annotation."""
    return tp.__name__ if isinstance(tp, type) else repr(tp).replace("typing.", "")
