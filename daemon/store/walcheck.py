"""WAL checkpoints off the commit path: a thread of its own copies committed pages into the file."""

from __future__ import annotations

import contextlib
import sqlite3
import threading

import structlog

from daemon.observe.threads import name_os_thread

log = structlog.get_logger(__name__)
#: The writer connection's own automatic checkpoint, in WAL pages: only a safety net that
#: bounds the WAL (~40 MB) should this thread fall behind or fail.
AUTOCHECKPOINT_PAGES = 10_000
#: The writer rings after this many commits (a batch of many writes counts for more): about
#: the 1,000 WAL pages at which SQLite itself would checkpoint, for commits of one checkpoint.
RING_EVERY = 64
#: Writes in one batch that count as one more commit towards RING_EVERY.
WRITES_PER_COMMIT = 32


class WalCheckpointer:
    """Runs PASSIVE checkpoints on its own connection and thread whenever the writer rings.

    With SQLite's automatic checkpoint, the commit that crosses 1,000 WAL pages copies them
    all into the database (and syncs the file) before its writes are acknowledged, so one
    acknowledgement in ~100 waited for it. A PASSIVE checkpoint blocks neither the writer
    nor the readers; the writer only releases a lock, and rings merge while one runs. When
    the disk runs out of room (see daemon.store.room) the next one is a TRUNCATE checkpoint,
    which waits for the readers and the writer and then empties the WAL file.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._bell = threading.Lock()
        self._bell.acquire()
        self._closing = False
        self._truncate_due = False
        self.checkpoints = 0  #: checkpoints run (the tests and benchmarks read it)
        self.failures = 0  #: checkpoints that raised (the next ring tries again)
        self._thread = threading.Thread(target=self._run, name="workflowd-walcheck", daemon=True)

    def start(self) -> None:
        """Start the thread; it sleeps until rung."""
        self._thread.start()

    def ring(self) -> None:
        """Ask for a checkpoint (any thread, never blocks); rings before it runs merge."""
        with contextlib.suppress(RuntimeError):  # rung already, not yet taken
            self._bell.release()

    def truncate(self) -> None:
        """Ask for a TRUNCATE checkpoint, which gives the WAL file's room back once it is done."""
        self._truncate_due = True
        self.ring()

    def close(self) -> None:
        """Stop the thread (after the checkpoint it may be running) and close its connection."""
        self._closing = True
        self.ring()
        if self._thread.is_alive():
            self._thread.join()
        else:  # never started
            self._conn.close()

    def _run(self) -> None:
        name_os_thread("wd-walcheck")
        try:
            while True:
                self._bell.acquire()
                if self._closing:
                    return
                mode, self._truncate_due = "TRUNCATE" if self._truncate_due else "PASSIVE", False
                try:
                    # A TRUNCATE kept from finishing by a reader returns busy, not an error:
                    # the writer asks again at its next refused batch.
                    self._conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
                    self.checkpoints += 1
                except sqlite3.Error as e:  # the writer's own checkpoint bounds the WAL meanwhile
                    self.failures += 1
                    if self.failures == 1:
                        log.warning("store_checkpoint_failed", error=f"{type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
