"""Storage faults for tests and benchmarks: a small tmpfs to fill, and a write lock held elsewhere."""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest


class MountRefused(Exception):
    """Mounting a tmpfs is not permitted here (not root, or in a container that forbids it)."""


@asynccontextmanager
async def tmpfs(where: Path, size: str = "16m") -> AsyncIterator[Path]:
    """Mount a tmpfs of `size` at `where` (made here); raise MountRefused if mount is refused."""
    await anyio.Path(where).mkdir()
    mount = await anyio.run_process(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=False
    )
    if mount.returncode != 0:
        raise MountRefused(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield where
    finally:
        await anyio.run_process(["umount", "-l", str(where)], check=False)


@asynccontextmanager
async def small_disk(where: Path, size: str = "16m") -> AsyncIterator[Path]:
    """Mount a small tmpfs at `where`; the calling test is skipped where mount is refused."""
    try:
        async with tmpfs(where, size) as disk:
            yield disk
    except MountRefused as e:
        pytest.skip(str(e))


def fill(disk: Path, name: str = "ballast") -> Path:
    """Fill the file system of `disk` with a ballast file until the next write fails."""
    ballast = disk / name
    with ballast.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return ballast


def hold_write_lock(db: Path, how: str = "EXCLUSIVE") -> sqlite3.Connection:
    """Take the database's write lock from this process, as another program could.

    `how` is the BEGIN mode; in WAL mode IMMEDIATE and EXCLUSIVE both keep every other writer
    out and let readers in. End it with `ROLLBACK` (or `COMMIT`) and close the connection.
    """
    conn = sqlite3.connect(db, isolation_level=None, timeout=10, check_same_thread=False)
    conn.execute(f"BEGIN {how}")
    return conn
