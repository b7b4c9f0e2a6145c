"""A definition indexed by name: validation, statement kinds, and what a goto may target."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, TypeVar

from daemon.core.statements import (
    Branch,
    Break,
    Continue,
    For,
    Go,
    If,
    On,
    Return,
    Section,
    Step,
    Stmt,
    Switch,
    Wait,
    WaitFor,
    _Branching,
    children,
)
from daemon.errors import UnknownStatement, ValidationError

_F = TypeVar("_F")
_N = TypeVar("_N")


class Definable(Protocol):
    """What the engine needs of a workflow: its definition and a way to undo a handler."""

    def definition(self) -> Section:
        """Build the statement tree from the current data."""

    def snapshot(self) -> bytes:
        """Capture the data."""

    def restore(self, snap: bytes) -> None:
        """Put back data captured by `snapshot`."""


#: The kind of every named thing in a definition, as `show`, `lint`, reload and goto name it.
KINDS: dict[type[Any], str] = {
    Step: "step",
    Wait: "wait",
    WaitFor: "wait_for",
    For: "for",
    Go: "go",
    Branch: "branch",
    On: "event",
}


def kind_of(node: Stmt | Branch | On) -> str:
    """Return the kind of a named statement, branch or Wait case."""
    for base in type(node).__mro__:
        if base in KINDS:
            return KINDS[base]
    raise UnknownStatement(f"not a named statement: {node!r}")


class Named(NamedTuple):
    """One named thing found by `named`: a statement, a branch or a Wait case."""

    name: str
    kind: str
    node: Stmt | Branch | On
    #: For a Wait case, the name of its Wait; else "".
    wait: str = ""


def named(root: Stmt, *, into_go: bool = True) -> Iterator[Named]:
    """Yield every named thing under `root`, duplicates included; `into_go=False` stays in one thread."""
    stack = [root]
    while stack:
        s = stack.pop()
        match s:
            case Step() | WaitFor() | For() | Go():
                yield Named(s.name, kind_of(s), s)
            case Wait(name=n, cases=cases):
                yield Named(n, "wait", s)
                yield from (Named(c.event, "event", c, n) for c in cases)
            case _Branching(branches=branches):
                yield from (Named(b.name, "branch", b) for b in branches)
        if into_go or not isinstance(s, Go):
            stack.extend(reversed(list(children(s))))


def goto_targets(body: Stmt) -> dict[str, Named]:
    """Map each named thing of the thread running `body` to it; a Go's own body is another thread's."""
    return {n.name: n for n in named(body, into_go=False)}


class Definition:
    """A validated definition with its named statements indexed by name."""

    __slots__ = ("named", "root")

    def __init__(self, root: Section) -> None:
        self.root = root
        #: Every named statement, If/Switch branch and Wait case (by its event): names are
        #: unique within a definition, so one dict indexes them all.
        self.named: dict[str, Stmt | Branch | On] = {}
        self._index(root, in_loop=False)

    def get(self, name: str, kind: type[_N]) -> _N | None:
        """Return the `kind` (e.g. Step) called `name`, or None."""
        node = self.named.get(name)
        return node if isinstance(node, kind) else None

    def _all(self, kind: type[_N]) -> dict[str, _N]:
        return {name: node for name, node in self.named.items() if isinstance(node, kind)}

    @property
    def steps(self) -> dict[str, Step]:
        """Return the Steps by name."""
        return self._all(Step)

    @property
    def waits(self) -> dict[str, Wait]:
        """Return the Waits by name."""
        return self._all(Wait)

    @property
    def wait_fors(self) -> dict[str, WaitFor]:
        """Return the WaitFors by name."""
        return self._all(WaitFor)

    @property
    def gos(self) -> dict[str, Go]:
        """Return the Go statements by name."""
        return self._all(Go)

    @property
    def events(self) -> dict[str, On]:
        """Return the Wait cases by event name."""
        return self._all(On)

    def _claim(self, name: str, node: Stmt | Branch | On, what: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValidationError(f"{what} needs a non-empty string name, got {name!r}")
        if name in self.named:
            raise ValidationError(f"duplicate name {name!r} ({what})")
        self.named[name] = node

    def _index(self, stmt: Stmt, in_loop: bool) -> None:
        (_INDEX.get(type(stmt)) or dispatch_entry(_INDEX, stmt))(self, stmt, in_loop)

    def _section(self, stmt: Section, in_loop: bool) -> None:
        for s in stmt.stmts:
            (_INDEX.get(type(s)) or dispatch_entry(_INDEX, s))(self, s, in_loop)

    def _step(self, stmt: Step, in_loop: bool) -> None:
        self._claim(stmt.name, stmt, "step")

    def _branching(self, stmt: _Branching, in_loop: bool) -> None:
        for b in stmt.branches:
            self._claim(b.name, b, "branch")
            self._section(b.body, in_loop)

    def _for(self, stmt: For, in_loop: bool) -> None:
        self._claim(stmt.name, stmt, "for")
        self._section(stmt.body, True)

    def _wait(self, stmt: Wait, in_loop: bool) -> None:
        self._claim(stmt.name, stmt, "wait")
        if not stmt.cases:
            raise ValidationError(f"wait {stmt.name!r} has no cases")
        for c in stmt.cases:
            if not isinstance(c, On):
                raise ValidationError(f"wait {stmt.name!r}: cases must be On(...), got {c!r}")
            self._claim(c.event, c, "event")
            self._section(c.body, in_loop)

    def _wait_for(self, stmt: WaitFor, in_loop: bool) -> None:
        self._claim(stmt.name, stmt, "wait_for")

    def _go(self, stmt: Go, in_loop: bool) -> None:
        self._claim(stmt.name, stmt, "go")
        self._section(stmt.body, False)

    def _jump(self, stmt: Break | Continue, in_loop: bool) -> None:
        if not in_loop:
            raise ValidationError(f"{type(stmt).__name__}() outside a For")

    def _return(self, stmt: Return, in_loop: bool) -> None:
        pass  # Return may end a thread anywhere.


# A dict from statement type to method: cheaper than `match` on class patterns.
_INDEX: dict[type[Stmt], Callable[[Definition, Any, bool], None]] = {
    Section: Definition._section,
    Step: Definition._step,
    _Branching: Definition._branching,
    If: Definition._branching,
    Switch: Definition._branching,
    For: Definition._for,
    Wait: Definition._wait,
    WaitFor: Definition._wait_for,
    Go: Definition._go,
    Break: Definition._jump,
    Continue: Definition._jump,
    Return: Definition._return,
}


def dispatch_entry(table: dict[type[Stmt], _F], stmt: Stmt) -> _F:
    """Return `table`'s entry for a subclass of a known statement type, and remember it."""
    for base in type(stmt).__mro__:
        if base in table:
            table[type(stmt)] = table[base]
            return table[base]
    raise UnknownStatement(f"not a statement: {stmt!r}")


def validate(section: Section) -> None:
    """Raise ValidationError if the definition is not well formed (e.g. duplicate names)."""
    Definition(section)
