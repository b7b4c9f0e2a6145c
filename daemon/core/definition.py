"""A definition indexed by name: validation, statement kinds, and what a goto may target."""

from __future__ import annotations

from collections.abc import Iterator
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
        # The root may be any statement; a Section's statements are walked by `_walk`.
        self._walk(root.stmts if type(root) is Section else (root,), False)

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
        # The whole check; `_walk` inlines the usual case and calls this for the rest.
        if not isinstance(name, str) or not name:
            raise ValidationError(f"{what} needs a non-empty string name, got {name!r}")
        if name in self.named:
            raise ValidationError(f"duplicate name {name!r} ({what})")
        self.named[name] = node

    def _walk(self, stmts: tuple[Any, ...], in_loop: bool) -> None:
        # One frame per block, not per statement: this runs on every resume (and validates).
        # Each claim is checked inline; `_claim` is called only to accept or reject an odd one.
        named, claim = self.named, self._claim
        for s in stmts:
            kind = KIND_CODE.get(type(s)) or dispatch_entry(KIND_CODE, s)
            if kind is LEAF:
                name = s.name
                if type(name) is not str or not name or name in named:
                    claim(name, s, "step" if isinstance(s, Step) else "wait_for")
                else:
                    named[name] = s
            elif kind is WAIT:
                name = s.name
                if type(name) is not str or not name or name in named:
                    claim(name, s, "wait")
                else:
                    named[name] = s
                if not s.cases:
                    raise ValidationError(f"wait {name!r} has no cases")
                for c in s.cases:
                    if not isinstance(c, On):
                        raise ValidationError(f"wait {name!r}: cases must be On(...), got {c!r}")
                    event = c.event
                    if type(event) is not str or not event or event in named:
                        claim(event, c, "event")
                    else:
                        named[event] = c
                    if c.body.stmts:
                        self._walk(c.body.stmts, in_loop)
            elif kind is FOR:
                name = s.name
                if type(name) is not str or not name or name in named:
                    claim(name, s, "for")
                else:
                    named[name] = s
                self._walk(s.body.stmts, True)
            elif kind is BRANCHING:
                for b in s.branches:
                    name = b.name
                    if type(name) is not str or not name or name in named:
                        claim(name, b, "branch")
                    else:
                        named[name] = b
                    self._walk(b.body.stmts, in_loop)
            elif kind is SECTION:
                self._walk(s.stmts, in_loop)
            elif kind is GO:
                claim(s.name, s, "go")
                self._walk(s.body.stmts, False)
            elif kind is not RETURN and not in_loop:  # Break, Continue
                raise ValidationError(f"{type(s).__name__}() outside a For")


#: Codes of the statement kinds the engine's walks tell apart (compared with `is`).
LEAF, WAIT, FOR, BRANCHING, SECTION, GO, BREAK, CONTINUE, RETURN = (
    "leaf", "wait", "for", "branching", "section", "go", "break", "continue", "return"
)  # fmt: skip
#: The kind code of each statement type (a dict lookup is cheaper than `match` on classes);
#: a subclass of a known type is added by `dispatch_entry` on first sight.
KIND_CODE: dict[type[Stmt], str] = {
    Step: LEAF,
    WaitFor: LEAF,
    Wait: WAIT,
    For: FOR,
    _Branching: BRANCHING,
    If: BRANCHING,
    Switch: BRANCHING,
    Section: SECTION,
    Go: GO,
    Break: BREAK,
    Continue: CONTINUE,
    Return: RETURN,
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
