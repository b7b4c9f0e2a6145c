"""Tests for daemon.ops.standby: a standby's reads of the shared database, and its refusals."""

from __future__ import annotations

import pytest

from daemon.errors import Unavailable, WorkflowNotFound
from daemon.ops.standby import Standby
from daemon.store.base import WorkflowRow
from daemon.store.postgres import PostgresStore


async def test_reads_what_the_holder_wrote_and_refuses_changes(pg_dsn: str) -> None:
    """list, show, history, counts and nodes read the database; changes name the holder."""
    async with PostgresStore.open(pg_dsn, node_id="a", lease_s=30.0) as holder:
        row = WorkflowRow("w", "Demo", "Waiting", '{"i":1}', '{"threads":[]}')
        await holder.create(row, history=[("started", {"input": {}})])
        async with PostgresStore.reader(pg_dsn, node_id="b", lease_s=30.0) as store:
            standby = Standby(store)
            assert [n["node_id"] for n in await standby.nodes()] == ["a"]
            assert standby.holder == "a"
            assert [r["workflow_id"] for r in await standby.list()] == ["w"]
            shown = await standby.show("w")
            assert (shown["status"], shown["data"]) == ("Waiting", {"i": 1})
            assert standby.owner(shown["status"]) == "a" and standby.owner("Finished") is None
            assert [h["kind"] for h in await standby.history("w")] == ["started"]
            assert await standby.counts() == {"Waiting": 1}
            with pytest.raises(WorkflowNotFound):
                await standby.show("nope")
            for change in (standby.start("Demo"), standby.send("w", "go"), standby.cancel("w")):
                with pytest.raises(Unavailable, match="node 'a' runs the workflows"):
                    await change
            with pytest.raises(Unavailable, match="pg_dump"):
                await standby.backup("/tmp/copy")
        assert await holder.counts() == {"Waiting": 1}
