"""The workflow DSL: the statements a `definition()` returns, and walking them."""

from __future__ import annotations

import inspect
import types
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from daemon.core.handler import Handler

#: A condition is a plain value evaluated when the definition is built, or a callable.
Cond = bool | object | Callable[[], object]
#: A step's action: sync or async, no arguments.
Action = Callable[[], object] | Callable[[], Awaitable[object]]


def truth(cond: Cond) -> bool:
    """Evaluate a condition that may be a value or a zero-argument callable."""
    if isinstance(cond, bool):  # the usual case: a comparison evaluated when the tree was built
        return cond
    return bool(cond()) if callable(cond) else bool(cond)


class NonRetryableError(Exception):
    """Raised by a step to fail its workflow at once instead of being retried."""


@dataclass(frozen=True, slots=True)
class Retry:
    """How a failing step is retried; None fields fall back to the daemon's configuration."""

    initial_s: float | None = None
    max_s: float | None = None
    #: 0 retries forever.
    max_attempts: int | None = None
    #: Exceptions that fail the workflow at once.
    non_retryable: tuple[type[BaseException], ...] = ()


class Stmt:
    """Base class of every statement."""

    __slots__ = ()


@dataclass(slots=True, eq=False)
class Section(Stmt):
    """A block of statements run in order."""

    stmts: tuple[Stmt, ...]


#: Makes a Section without running its __init__: a definition is rebuilt after every step,
#: and each of its blocks costs one Python call less (S, For, On).
_new = object.__new__


def S(*stmts: Stmt) -> Section:
    """Build a section (a block) from statements."""
    section = _new(Section)
    section.stmts = stmts
    return section


@dataclass(slots=True, eq=False)
class Step(Stmt):
    """Run `action`; its effect on the data is checkpointed right after."""

    name: str
    action: Action
    retry: Retry | None = None
    #: Seconds after which the step fails with TimeoutError (and is retried): an async action
    #: is cancelled; a sync one's thread is abandoned, its worker slot freed.
    timeout: float | None = None
    #: Run a sync action on the event loop itself, with no thread hand-off: only for trivial
    #: actions that never block (no I/O, no sleep); `timeout` cannot stop them.
    inline: bool = False


@dataclass(slots=True, eq=False)
class Branch:
    """One arm of an If or a Switch: taken when `cond` is the first true one."""

    cond: Cond
    name: str
    body: Section
    default: bool = False


class _Branching(Stmt):
    """A statement that runs the body of its first true branch."""

    __slots__ = ("branches",)

    def __init__(self, branches: list[Branch]) -> None:
        self.branches = branches


class If(_Branching):
    """Run the first branch whose condition holds: `If(c, "a", ...).elif_(...).else_(...)`."""

    __slots__ = ()

    def __init__(self, cond: Cond, name: str, *stmts: Stmt) -> None:
        super().__init__([Branch(cond, name, Section(stmts))])

    def elif_(self, cond: Cond, name: str, *stmts: Stmt) -> If:
        """Add a branch tried when the earlier ones are false."""
        self.branches.append(Branch(cond, name, Section(stmts)))
        return self

    def else_(self, name: str, *stmts: Stmt) -> If:
        """Add the branch taken when every condition is false."""
        self.branches.append(Branch(True, name, Section(stmts), default=True))
        return self


def Case(cond: Cond, name: str, *stmts: Stmt) -> Branch:
    """Build a Switch case."""
    return Branch(cond, name, Section(stmts))


def Default(name: str, *stmts: Stmt) -> Branch:
    """Build the Switch case taken when no other case holds."""
    return Branch(True, name, Section(stmts), default=True)


class Switch(_Branching):
    """Run the first case whose condition holds."""

    __slots__ = ()

    def __init__(self, *cases: Branch) -> None:
        super().__init__(list(cases))


@dataclass(slots=True, eq=False, init=False)
class For(Stmt):
    """Loop over `stmts` while `cond` holds."""

    name: str
    cond: Cond
    body: Section

    def __init__(self, name: str, cond: Cond, *stmts: Stmt) -> None:
        body = _new(Section)
        body.stmts = stmts
        self.name, self.cond, self.body = name, cond, body


class Break(Stmt):
    """Leave the innermost For."""

    __slots__ = ()


class Continue(Stmt):
    """Skip to the next iteration of the innermost For."""

    __slots__ = ()


class Return(Stmt):
    """End the current thread; ending the main thread finishes the workflow."""

    __slots__ = ()


@dataclass(slots=True, eq=False, init=False)
class On:
    """One case of a Wait: the event's name, its handler and what runs when it fires."""

    event: str
    handler: Handler
    body: Section

    def __init__(self, event: str, handler: Handler, *stmts: Stmt) -> None:
        body = _new(Section)
        body.stmts = stmts
        self.event, self.handler, self.body = event, handler, body


@dataclass(slots=True, eq=False, init=False)
class Wait(Stmt):
    """Block the thread until one of the events arrives, then run that case."""

    name: str
    cases: tuple[On, ...]

    def __init__(self, name: str, *cases: On) -> None:
        self.name, self.cases = name, cases


@dataclass(slots=True, eq=False)
class WaitFor(Stmt):
    """Block the thread until `cond` holds, then call `handler()` if given."""

    name: str
    cond: Cond
    handler: Callable[[], object] | None = None


@dataclass(slots=True, eq=False, init=False)
class Go(Stmt):
    """Start a parallel thread running `body`; `id` tells apart threads started in a loop."""

    name: str
    body: Section
    id: str | None = field(default=None)

    def __init__(self, name: str, body: Stmt, id: str | None = None) -> None:
        self.name, self.id = name, id
        self.body = body if isinstance(body, Section) else Section((body,))

    @property
    def thread_id(self) -> str:
        """Return the id of the thread this statement starts."""
        return self.name if self.id is None else f"{self.name}:{self.id}"


def children(stmt: Stmt) -> Iterator[Stmt]:
    """Yield the statements directly inside `stmt` (Go bodies included)."""
    match stmt:
        case Section(stmts=stmts):
            yield from stmts
        case _Branching(branches=branches):
            for b in branches:
                yield b.body
        case For(body=body) | Go(body=body):
            yield body
        case Wait(cases=cases):
            for c in cases:
                yield c.body


def walk(stmt: Stmt) -> Iterator[Stmt]:
    """Yield `stmt` and every statement inside it, depth first."""
    stack = [stmt]
    while stack:
        s = stack.pop()
        yield s
        stack.extend(reversed(list(children(s))))


def find_step(section: Stmt, name: str) -> Step | None:
    """Return the Step called `name`, or None."""
    for s in walk(section):
        if isinstance(s, Step) and s.name == name:
            return s
    return None


def find_handler(section: Stmt, event: str) -> Handler | None:
    """Return the handler of the Wait case for `event`, or None."""
    for s in walk(section):
        if isinstance(s, Wait):
            for c in s.cases:
                if c.event == event:
                    return c.handler
    return None


def definition_to_dict(stmt: Stmt) -> dict[str, Any]:
    """Describe the statement tree as plain JSON-able data."""
    kids = [definition_to_dict(c) for c in children(stmt)]
    match stmt:
        case Section():
            return {"type": "section", "children": kids}
        case Step(name=name):
            return {"type": "step", "name": name}
        case _Branching(branches=branches):
            arms = [
                {"name": b.name, "default": b.default, "children": k["children"]}
                for b, k in zip(branches, kids, strict=True)
            ]
            return {"type": "if" if isinstance(stmt, If) else "switch", "branches": arms}
        case For(name=name):
            return {"type": "for", "name": name, "children": kids[0]["children"]}
        case Wait(name=name, cases=cases):
            arms = [
                {"event": c.event, "handler": c.handler.type, "children": k["children"]}
                for c, k in zip(cases, kids, strict=True)
            ]
            return {"type": "wait", "name": name, "cases": arms}
        case WaitFor(name=name):
            return {"type": "wait_for", "name": name}
        case Go(name=name):
            return {"type": "go", "name": name, "children": kids[0]["children"]}
        case Break():
            return {"type": "break"}
        case Continue():
            return {"type": "continue"}
        case Return():
            return {"type": "return"}
    return {"type": type(stmt).__name__}


_PLAIN_CALLABLES = (types.FunctionType, types.MethodType)


def is_async(fn: Any) -> TypeGuard[Callable[[], Awaitable[Any]]]:
    """Tell whether `fn` is an async function, as inspect.iscoroutinefunction does, but faster."""
    # A plain function or bound method (nearly every step) needs no trip through inspect.
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None and type(fn) in _PLAIN_CALLABLES:
        return bool(code.co_flags & inspect.CO_COROUTINE)
    return inspect.iscoroutinefunction(fn)
