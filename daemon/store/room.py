"""Room kept free on the database's disk, so that a WAL checkpoint can always grow the file."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)
#: Free space below which the store refuses writes (or the WAL file's size, if larger).
KEEP_FREE_BYTES = 4 << 20


class DiskRoom:
    """Tells the writer when a batch must be refused because the disk is nearly full.

    A checkpoint copies the WAL's pages into the database file, which may have to grow, and
    only a finished checkpoint lets the WAL start over or shrink. Written to the last byte,
    the WAL would take the room its own checkpoint needs: every later write would fail, even
    after a restart, until someone freed space the daemon itself was holding. So writes stop
    while the free space is below the larger of `keep_bytes` and the WAL file's size (every
    page in the WAL may be new to the database file), and each refusal asks for a TRUNCATE
    checkpoint, which gives the WAL's room back once no reader holds it.
    """

    def __init__(
        self, path: Path, truncate: Callable[[], None], keep_bytes: int = KEEP_FREE_BYTES
    ) -> None:
        self._folder = str(path.parent)
        self._wal = f"{path}-wal"
        self._truncate = truncate
        self._keep = keep_bytes
        # Root may write into the blocks a file system reserves for it; others may not.
        self._root = os.geteuid() == 0
        self._low = False  #: refusing now: logged once when it begins, once when it ends

    def refusal(self) -> Exception | None:
        """Return the error to fail the next batch with, or None if there is room to write it."""
        try:
            fs = os.statvfs(self._folder)
        except OSError:
            return None  # nothing known: the write itself says what is wrong
        free = (fs.f_bfree if self._root else fs.f_bavail) * fs.f_frsize
        try:
            wal = os.stat(self._wal).st_size
        except OSError:
            wal = 0
        kept = max(self._keep, wal)
        if free >= kept:
            if self._low:
                self._low = False
                log.info("store_disk_room_back", free_bytes=free)
            return None
        if not self._low:
            self._low = True
            log.warning("store_disk_low", free_bytes=free, kept_bytes=kept, folder=self._folder)
        self._truncate()
        return sqlite3.OperationalError(
            f"database or disk is full: {free} bytes free in {self._folder},"
            f" {kept} kept for the WAL's checkpoint"
        )
