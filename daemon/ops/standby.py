"""What a standby daemon serves on its control socket: reads of the shared database, no writes.

While another daemon holds the PostgreSQL database's lease, `workflowctl` against a standby
still sees every workflow (`list`, `show`, `history`, `ping` with the nodes); whatever would
change a workflow is answered `unavailable`, naming the node that runs them.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec

from daemon.errors import Unavailable, WorkflowNotFound
from daemon.runtime.children import composition
from daemon.runtime.runtime import summary
from daemon.store.base import Position
from daemon.store.postgres import PostgresStore
from daemon.store.schema import FINAL


class Standby:
    """The control socket's backend and daemon ops while this daemon stands by."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        #: The node holding the lease, as the last `nodes` read saw it.
        self.holder: str | None = None

    def _refuse(self) -> Unavailable:
        runs = f"node {self.holder!r} runs the workflows" if self.holder else "no node holds it"
        return Unavailable(f"this daemon stands by for the database's lease ({runs})")

    # -- Backend ----------------------------------------------------------------------------

    async def start(
        self,
        workflow: str,
        workflow_id: str | None = None,
        input: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Refuse: only the lease holder starts workflows."""
        raise self._refuse()

    async def send(self, workflow_id: str, event: str, input: Any = None, **_: Any) -> Any:
        """Refuse: only the lease holder applies events."""
        raise self._refuse()

    async def cancel(self, workflow_id: str) -> dict[str, Any]:
        """Refuse: only the lease holder cancels."""
        raise self._refuse()

    async def list(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        parent: str | None = None,
    ) -> builtins.list[dict[str, Any]]:
        """Summarize workflows, newest first, as the holder would."""
        rows, _ = await self.page(status=status, workflow=workflow, limit=limit, parent=parent)
        return rows

    async def page(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        after: Position | None = None,
        parent: str | None = None,
    ) -> tuple[builtins.list[dict[str, Any]], Position | None]:
        """Summarize up to `limit` workflows after `after`, newest first; return where to go on."""
        rows, position = await self._store.page(
            status=status, name=workflow, limit=limit, after=after, parent=parent
        )
        return [summary(row) for row in rows], position

    async def show(self, workflow_id: str) -> dict[str, Any]:
        """Return a workflow's data, state and error as stored."""
        row = await self._store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        out = summary(row)
        out.update(
            data=_json_or_text(row.data),
            state=_json_or_text(row.state),
            attempt=row.attempt,
            next_run_at=row.next_run_at,
            created_at=row.created_at,
        )
        out.update(await composition(self._store, row))
        out["running"] = []  # a standby runs nothing; the holder's `show` names its steps
        return out

    async def history(
        self, workflow_id: str, *, limit: int = 1000
    ) -> builtins.list[dict[str, Any]]:
        """Return a workflow's history, oldest first."""
        if await self._store.get(workflow_id) is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        rows = await self._store.history(workflow_id, limit=limit)
        return [{"at": r.at, "kind": r.kind, **r.detail} for r in rows]

    async def counts(self) -> dict[str, int]:
        """Count workflows by status."""
        return await self._store.counts()

    def busy(self) -> int:
        """Count nothing: a standby runs no workflow."""
        return 0

    def incompatible(self) -> int:
        """Count nothing: a standby checks no workflow against its code."""
        return 0

    async def wait(
        self,
        workflow_ids: builtins.list[str],
        *,
        any: bool = False,
        timeout_s: float | None = None,
        until: str = "ended",
    ) -> dict[str, Any]:
        """Refuse: endings are seen by the daemon that runs the workflows."""
        raise self._refuse()

    def types(self) -> builtins.list[dict[str, Any]]:
        """Refuse: the workflow types are the holder's (its code may differ from ours)."""
        raise self._refuse()

    def subscribe_logs(
        self, workflow_id: str | None = None, *, follow: bool = True
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Refuse: the logs of the workflows are the holder's."""
        raise self._refuse()

    # -- DaemonOps --------------------------------------------------------------------------

    async def reload(self) -> dict[str, Any]:
        """Refuse over the socket (SIGHUP is kept for when it holds the lease)."""
        raise self._refuse()

    async def backup(self, path: str) -> dict[str, Any]:
        """Refuse, as the holder does on PostgreSQL."""
        await self._store.backup(path)  # type: ignore[arg-type]  # raises, naming pg_dump
        raise self._refuse()  # pragma: no cover - backup always raises on PostgreSQL

    async def nodes(self) -> builtins.list[dict[str, Any]]:
        """List the daemons on the database, the lease holder first."""
        found = sorted(await self._store.nodes(), key=lambda n: n["role"] != "holder")
        holders = [n["node_id"] for n in found if n["role"] == "holder"]
        self.holder = holders[0] if holders else None
        return found

    def role(self) -> str:
        """Say what this daemon is to `ping`: one that stands by."""
        return "standby"

    def owner(self, status: str) -> str | None:
        """Name the node that runs a workflow in `status`: the holder (none once it ended)."""
        return None if status in FINAL else self.holder


def _json_or_text(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
