"""The read methods both stores share, each query written once for SQLite and PostgreSQL."""

from __future__ import annotations

import abc
import builtins
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import structlog

from daemon.observe.hooks import HookRow
from daemon.store.base import HistoryRow, InboxRow, Position, WorkflowRow
from daemon.store.schema import COLS, FINAL, detail_of

log = structlog.get_logger(__name__)
#: A workflow row's columns (schema.COLS) come first in every row read of one; a list page's
#: row then ends in its position's tie-breaker, after `updated_at` in some dialects.
N_COLS = len(COLS.split(","))
UPDATED_AT = [c.strip() for c in COLS.split(",")].index("updated_at")
INBOX_COLS = "id, workflow_id, event, thread_id, pc, input, created_at"


@dataclass(frozen=True)
class Dialect:
    """What differs between the stores' reads: placeholders, the list query, the inbox."""

    #: Placeholders are numbered ($1, $2, ...: PostgreSQL) rather than all `?` (SQLite).
    numbered: bool
    #: The store's `list` query builder (its schema module's list_query).
    list_query: Callable[..., tuple[str, builtins.list[Any]]]
    #: A condition keeping only the inbox rows that are callbacks, or "" where all are.
    callbacks: str = ""

    def sql(self, text: str) -> str:
        """Return `text`, written with `?` placeholders, in this dialect."""
        return _numbered(text) if self.numbered else text


@functools.lru_cache(maxsize=256)
def _numbered(text: str) -> str:
    """Number the `?` placeholders of `text` ($1, $2, ...), leaving quoted literals alone."""
    parts = text.split("'")
    n = 0
    for i in range(0, len(parts), 2):  # even parts are outside '...' literals
        pieces = parts[i].split("?")
        out = [pieces[0]]
        for piece in pieces[1:]:
            n += 1
            out.append(f"${n}{piece}")
        parts[i] = "".join(out)
    return "'".join(parts)


class Reads(abc.ABC):
    """The reads of the `Store` and `Gauges` protocols, which both stores answer alike.

    A store names its dialect and supplies `_rows`, which runs one query on its read
    connections (`lister=True`: those kept for `list` pages). `_by_id`, the keyset loop over
    workflows in id order, serves `unfinished` here and the SQLite store's sleeper reads.
    """

    _dialect: ClassVar[Dialect]

    @abc.abstractmethod
    async def _rows(
        self, sql: str, params: Sequence[Any] = (), *, lister: bool = False
    ) -> builtins.list[Any]:
        """Run one query in this dialect on the store's read connections; return its rows."""

    async def _query(
        self, sql: str, params: Sequence[Any] = (), *, lister: bool = False
    ) -> builtins.list[Any]:
        return await self._rows(self._dialect.sql(sql), params, lister=lister)

    async def get(self, workflow_id: str) -> WorkflowRow | None:
        """Return the workflow with that id, or None."""
        rows = await self._query(f"SELECT {COLS} FROM workflows WHERE id = ?", (workflow_id,))
        return WorkflowRow(*rows[0]) if rows else None

    async def list(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        limit: int = 100,
        parent: str | None = None,
    ) -> builtins.list[WorkflowRow]:
        """Return up to `limit` workflows, most recently updated first."""
        rows, _ = await self.page(status=status, name=name, limit=limit, parent=parent)
        return rows

    async def page(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        limit: int = 100,
        after: Position | None = None,
        parent: str | None = None,
    ) -> tuple[builtins.list[WorkflowRow], Position | None]:
        """Return up to `limit` workflows after `after`, newest first, and where to go on."""
        sql, params = self._dialect.list_query(status, name, after, parent)
        rows = await self._rows(sql, [*params, limit + 1], lister=True)
        more = len(rows) > limit
        rows = rows[:limit]
        position = (rows[-1][UPDATED_AT], rows[-1][-1]) if more else None
        return [WorkflowRow(*r[:N_COLS]) for r in rows], position

    async def unfinished(self, *, page: int = 1000) -> AsyncIterator[WorkflowRow]:
        """Yield every workflow not in a final status, reading `page` rows at a time."""
        async for rows in self._by_id(COLS, "status NOT IN (?, ?, ?)", FINAL, page):
            for r in rows:
                yield WorkflowRow(*r)

    async def ended_with_teardown_errors(self) -> builtins.list[WorkflowRow]:
        """Return the ended workflows that still hold a wait whose teardown failed."""
        rows = await self._query(
            f"SELECT {COLS} FROM workflows WHERE status IN (?, ?, ?)"
            " AND state LIKE '%\"TeardownError\"%'",
            FINAL,
        )
        return [WorkflowRow(*r) for r in rows]

    async def history(self, workflow_id: str, *, limit: int = 1000) -> builtins.list[HistoryRow]:
        """Return the workflow's newest `limit` history entries, oldest first."""
        rows = await self._query(
            "SELECT id, workflow_id, at, kind, detail FROM history WHERE workflow_id = ?"
            " ORDER BY seq DESC LIMIT ?",
            (workflow_id, limit),
        )
        return [HistoryRow(i, w, at, k, detail_of(d)) for i, w, at, k, d in reversed(rows)]

    async def inbox_pending(self, workflow_id: str | None = None) -> builtins.list[InboxRow]:
        """Return the callbacks not yet applied (of one workflow, or all), oldest first."""
        where, params = [], []
        if workflow_id is not None:
            where.append("workflow_id = ?")
            params.append(workflow_id)
        if self._dialect.callbacks:
            where.append(self._dialect.callbacks)
        sql = f"SELECT {INBOX_COLS} FROM inbox"
        sql += f" WHERE {' AND '.join(where)} ORDER BY id" if where else " ORDER BY id"
        out = []
        for i, w, e, t, pc, x, at in await self._query(sql, params):
            try:
                out.append(InboxRow(i, w, e, t, pc, msgspec.json.decode(x), at))
            except msgspec.DecodeError as err:  # one bad row must not stop recovery
                log.error("inbox_corrupt", inbox_id=i, workflow_id=w, event_name=e, error=str(err))
        return out

    async def counts(self) -> dict[str, int]:
        """Return how many workflows are in each status."""
        rows = await self._query("SELECT status, COUNT(*) FROM workflows GROUP BY status")
        return {status: n for status, n in rows}

    async def hooks_pending(self, *, after: int = 0, limit: int = 100) -> builtins.list[HookRow]:
        """Return up to `limit` endings with an id over `after`, oldest first."""
        rows = await self._query(
            "SELECT id, workflow_id, workflow, status, error, at, started_at FROM hook_runs"
            " WHERE id > ? ORDER BY id LIMIT ?",
            (after, limit),
        )
        return [HookRow(*r) for r in rows]

    async def counts_by_type(self) -> dict[tuple[str, str], int]:
        """Return how many workflows of each (type, status) there are."""
        rows = await self._query("SELECT name, status, COUNT(*) FROM workflows GROUP BY 1, 2")
        return {(name, status): n for name, status, n in rows}

    async def inbox_depth(self) -> int:
        """Return how many acknowledged events are not yet applied."""
        rows = await self._query("SELECT COUNT(*) FROM inbox")
        return int(rows[0][0])

    async def _by_id(
        self,
        columns: str,
        where: str,
        params: Sequence[Any],
        page: int,
        after: str = "",
        limit: int | None = None,
    ) -> AsyncIterator[builtins.list[Any]]:
        """Yield the (non-empty) pages of workflows matching `where` with an id over `after`.

        In id order, `page` rows at a time, up to `limit` rows in all.
        """
        sql = f"SELECT {columns} FROM workflows WHERE id > ? AND {where} ORDER BY id LIMIT ?"
        left = limit
        while left is None or left > 0:
            size = page if left is None else min(page, left)
            rows = await self._query(sql, (after, *params, size))
            if rows:
                yield rows
            if len(rows) < size:
                return
            after = rows[-1][0]
            if left is not None:
                left -= len(rows)
