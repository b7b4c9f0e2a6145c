"""The Store protocol the runtime depends on, and the rows a store returns.

A backend (SQLite today, PostgreSQL later) implements `Store`; nothing above this layer
imports a backend's module, except the composition root that opens one.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from daemon.errors import Unavailable

#: Where a listing stopped: the last row's (updated_at, rowid).
Position = tuple[float, int]
#: History entries written with a change: (kind, detail).
History = Sequence[tuple[str, dict[str, Any]]]


@dataclass(slots=True)
class WorkflowRow:
    """One workflow as stored: its data and engine state as JSON text."""

    id: str
    name: str
    status: str
    data: str
    state: str
    error: str | None = None
    attempt: int = 0
    next_run_at: float | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    #: The workflow whose Child case started this one.
    parent: str | None = None
    #: When (epoch seconds) it is cancelled with error `deadline passed` (its `timeout_s`).
    deadline: float | None = None


@dataclass(slots=True)
class HistoryRow:
    """One entry of a workflow's history."""

    id: int
    workflow_id: str
    at: float
    kind: str
    detail: dict[str, Any]


@dataclass(slots=True)
class InboxRow:
    """A callback that was acknowledged but not yet applied to its workflow."""

    id: int
    workflow_id: str
    event: str
    thread_id: str
    pc: int
    input: Any
    created_at: float


@dataclass(slots=True)
class ScheduleRow:
    """One schedule's durable state: the nominal time it handled last, pause, buffered fire."""

    name: str
    #: Every nominal time up to this one was fired or given up.
    last_nominal: float
    paused: bool = False
    #: A nominal time held back until the schedule's running workflow ends (buffer_one).
    buffered: float | None = None
    last_workflow_id: str | None = None
    last_fire_at: float | None = None


@dataclass(slots=True)
class FireRecord:
    """One fire, skip or catch-up of a schedule, as `workflowctl schedule show` lists it."""

    at: float
    #: "fired", "caught_up", "manual", "buffered" or "skipped".
    kind: str
    nominal: float | None = None
    workflow_id: str | None = None
    #: Why it was skipped or held back ("missed", "overlap"), or started ("buffered").
    reason: str | None = None
    #: How many nominal times a "skipped" record stands for.
    count: int = 1


@dataclass(slots=True)
class ScheduleFire:
    """One schedule's fire in a batch: the workflow it creates and how the schedule advances."""

    name: str
    row: WorkflowRow
    history: History = ()
    last_nominal: float | None = None
    clear_buffered: bool = False
    records: Sequence[FireRecord] = ()


class Store(Protocol):
    """Durable workflows, their history and the inbox of acknowledged callbacks."""

    @property
    def path(self) -> Path:
        """Return where the data lives (shown in logs)."""
        ...

    async def create(self, row: WorkflowRow, history: History = ()) -> bool:
        """Insert a new workflow; False if the id exists."""
        ...

    async def checkpoint(
        self,
        workflow_id: str,
        *,
        status: str,
        data: str,
        state: str,
        error: str | None = None,
        attempt: int = 0,
        next_run_at: float | None = None,
        history: History = (),
        inbox_done: Sequence[int] = (),
    ) -> None:
        """Write a workflow's data and state, its history and its applied inbox items at once."""
        ...

    async def set_status(
        self,
        workflow_id: str,
        *,
        status: str,
        error: str | None = None,
        attempt: int | None = None,
        next_run_at: float | None = None,
        history: History = (),
    ) -> None:
        """Change a workflow's status and retry bookkeeping, not its data."""
        ...

    async def inbox_put(
        self, workflow_id: str, event: str, input: Any, *, thread_id: str = "", pc: int = 0
    ) -> int:
        """Store an acknowledged callback until it is applied; return its id."""
        ...

    async def inbox_done(self, ids: Sequence[int]) -> None:
        """Drop inbox rows that will never be applied."""
        ...

    async def delete_finished(self, older_than: float) -> int:
        """Delete ended workflows last changed before `older_than`; return how many."""
        ...

    async def get(self, workflow_id: str) -> WorkflowRow | None:
        """Return one workflow, or None."""
        ...

    async def list(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        limit: int = 100,
        parent: str | None = None,
    ) -> builtins.list[WorkflowRow]:
        """Return workflows, most recently changed first; `parent` keeps one workflow's children."""
        ...

    async def page(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        limit: int = 100,
        after: Position | None = None,
        parent: str | None = None,
    ) -> tuple[builtins.list[WorkflowRow], Position | None]:
        """Return up to `limit` workflows listed after `after`, and the position to go on from.

        The position is None once no row is left. Rows come most recently changed first; a row
        changed between two pages moves ahead of the next page, so no row is listed twice.
        """
        ...

    def unfinished(self, *, page: int = 1000) -> AsyncIterator[WorkflowRow]:
        """Yield every workflow that has not ended, a page at a time."""
        ...

    async def ended_with_teardown_errors(self) -> builtins.list[WorkflowRow]:
        """Return the ended workflows that still hold a wait whose teardown failed."""
        ...

    async def history(self, workflow_id: str, *, limit: int = 1000) -> builtins.list[HistoryRow]:
        """Return a workflow's history, oldest first."""
        ...

    async def inbox_pending(self, workflow_id: str | None = None) -> builtins.list[InboxRow]:
        """Return the acknowledged callbacks not applied yet."""
        ...

    async def backup(self, dest: Path) -> int:
        """Write a consistent copy to a new file at `dest`; return its size."""
        ...

    async def counts(self) -> dict[str, int]:
        """Count workflows by status."""
        ...

    async def schedules_load(self, names: Sequence[str], now: float) -> builtins.list[ScheduleRow]:
        """Return the named schedules' state; a new one starts as handled up to `now`."""
        ...

    async def schedule_fire(
        self,
        name: str,
        row: WorkflowRow,
        history: History = (),
        *,
        last_nominal: float | None = None,
        clear_buffered: bool = False,
        records: Sequence[FireRecord] = (),
    ) -> bool:
        """Create a schedule's workflow and advance the schedule at once; False if the id exists."""
        ...

    async def schedule_fire_many(self, fires: Sequence[ScheduleFire]) -> builtins.list[bool]:
        """Do `schedule_fire` for each of `fires`, all in one transaction; True where inserted.

        The records' `at` is stamped as the transaction is written, so it tells when the fire
        was committed, not when it was asked for.
        """
        ...

    async def schedule_note(
        self,
        name: str,
        *,
        last_nominal: float | None = None,
        paused: bool | None = None,
        buffered: float | None = None,
        records: Sequence[FireRecord] = (),
    ) -> None:
        """Advance, pause, resume or buffer a schedule and record why, at once."""
        ...

    async def schedule_fires(self, name: str, *, limit: int = 100) -> builtins.list[FireRecord]:
        """Return a schedule's kept fires and skips, oldest first."""
        ...


class Gauges(Protocol):
    """The counts `/metrics` reads just before each scrape."""

    async def counts_by_type(self) -> dict[tuple[str, str], int]:
        """Return how many workflows of each (type, status) there are."""
        ...

    async def inbox_depth(self) -> int:
        """Return how many acknowledged events are not yet applied."""
        ...


#: A Waiting workflow as lean recovery reads it: id, type, deadline (`timeout_s`), state (JSON).
SleepingState = tuple[str, str, float | None, str]


@dataclass(frozen=True, slots=True)
class ScheduleUndo:
    """A fire committed early to take back: its workflow, and the schedule's row before it."""

    name: str
    workflow_id: str
    last_nominal: float
    last_workflow_id: str | None
    last_fire_at: float | None


@runtime_checkable
class EarlyFires(Protocol):
    """What a store may offer so that a large instant's fires are committed ahead of it."""

    async def schedule_fire_early(
        self, fires: Sequence[ScheduleFire], not_before: float
    ) -> builtins.list[bool]:
        """Do `schedule_fire_many`, the workflows to run from `not_before` on, not before.

        The records, the schedules' `last_fire_at` and the rows' times are stamped
        max(the commit, `not_before`): when the fire takes effect.
        """
        ...

    async def schedule_undo(
        self, undos: Sequence[ScheduleUndo], *, paused: str | None = None
    ) -> builtins.list[bool]:
        """Take back fires committed early and not yet run, in one transaction.

        Each workflow (still Resuming, its history) and fire record goes, and its schedule's
        row is put back; `paused` is paused in the same transaction. True where taken back
        (False: it is no longer Resuming, a cancel reached it, and its fire stands).
        """
        ...

    async def deferred_starts(self, now: float) -> dict[str, float]:
        """Return the Resuming workflows not to run before a time after `now`: id -> time."""
        ...


@runtime_checkable
class Sleepers(Protocol):
    """What a store may offer so that recovery reads its Waiting workflows apart."""

    def sleeping(
        self, *, page: int = 5000, after: str = "", limit: int | None = None
    ) -> AsyncIterator[builtins.list[WorkflowRow]]:
        """Yield the Waiting workflows with an id over `after` (up to `limit`), in id order."""
        ...

    def sleeping_states(
        self, *, page: int = 5000, after: str = ""
    ) -> AsyncIterator[builtins.list[SleepingState]]:
        """Yield id, type, deadline and state of each Waiting workflow with an id over `after`."""
        ...

    def awake(self, *, page: int = 1000) -> AsyncIterator[WorkflowRow]:
        """Yield every unfinished workflow that is not Waiting, a page at a time."""
        ...


# -- several daemons on one database (PostgreSQL); SQLite has no `Shared`: it owns everything --


class WorkflowLost(Unavailable):
    """Another daemon holds this workflow's lease now: this one wrote nothing for it."""


@dataclass(slots=True)
class Taken:
    """An inbox row an owner took: a callback or a cancel, and who waits for its answer."""

    row: InboxRow
    #: "callback" or "cancel".
    kind: str = "callback"
    #: The daemon (holder name) that received the request and waits for the answer, or None.
    reply_to: str | None = None


@dataclass(slots=True)
class Claimed:
    """Workflows this daemon just took the leases of, with the inbox rows they had."""

    rows: builtins.list[WorkflowRow]
    taken: builtins.list[Taken]
    #: The workflows among them whose pinned wait's node was gone: their setup is redone here.
    moved: builtins.list[str]
    #: Seconds until the first lease another daemon holds runs out, if any.
    next_expiry_s: float | None = None


class Shared(Protocol):
    """A store several daemons share: per-workflow leases, wake-ups, answers across daemons."""

    #: The node_id of this daemon.
    node_id: str
    #: This daemon's unique name on the database (the `owner` of what it holds).
    holder: str

    def owns(self, workflow_id: str) -> bool:
        """Tell whether this daemon holds the workflow's lease (as far as it knows)."""
        ...

    def leads(self) -> bool:
        """Tell whether this daemon runs the singleton duties (it holds the leader row)."""
        ...

    async def claim(self, limit: int) -> Claimed:
        """Take the leases of up to `limit` workflows nobody holds (and their inbox rows)."""
        ...

    async def renew(self) -> builtins.list[str]:
        """Extend every lease held, note this daemon alive; return the workflows lost."""
        ...

    def drop(self, workflow_id: str) -> None:
        """Forget a workflow's lease (lost, or its workflow dropped from memory)."""
        ...

    async def take_inbox(self) -> builtins.list[Taken]:
        """Take the new inbox rows of the workflows this daemon owns."""
        ...

    async def request(
        self,
        workflow_id: str,
        kind: str,
        event: str,
        input: Any,
        *,
        thread_id: str = "",
        pc: int = 0,
        reply: bool = False,
    ) -> int:
        """Store a callback or cancel for the workflow's owner, durably, and wake it."""
        ...

    async def answer(
        self, inbox_id: int, reply_to: str, ok: bool, value: Any, *, done: bool
    ) -> None:
        """Store the answer to a request for the daemon waiting for it (`done`: drop the row)."""
        ...

    async def answers(self) -> builtins.list[tuple[int, bool, Any]]:
        """Take the answers stored for this daemon: (inbox id, ok, value or error)."""
        ...

    async def owner_of(self, workflow_id: str) -> str | None:
        """Return the node_id of the daemon holding the workflow's lease, if any."""
        ...

    async def pin(self, pin: Sequence[str], unpin: Sequence[str]) -> None:
        """Pin workflows held here to this node (a FileWatch or SocketListen wait set up here),
        or unpin them."""
        ...

    async def listen(self, wake: Any) -> None:
        """Call `wake(channel, payload)` for each notification until cancelled (reconnecting)."""
        ...
