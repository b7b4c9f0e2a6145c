"""The `backup` op: a consistent copy of the database, written while the daemon runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from daemon.errors import BadRequest
from daemon.store.base import Store

log = structlog.get_logger()


async def backup(store: Store, path: str) -> dict[str, Any]:
    """Copy the database to a new file at the absolute `path`."""
    dest = Path(path)
    if not dest.is_absolute():
        raise BadRequest(f"the backup path must be absolute, not {path!r}")
    size = await store.backup(dest)
    log.info("backup_written", path=path, bytes=size)
    return {"path": path, "bytes": size}
