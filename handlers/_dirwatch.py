"""DirWatch: one non-recursive inotify watch of a directory, read in batches, cancellable."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Self

import anyio

# watchfiles' public `watch`/`awatch` open the inotify watch only when first iterated, and
# block there: a caller cannot start watching, then check the file, then wait. FileWatch needs
# exactly that order (a change between its check and the watch would be lost), and only the
# class behind those functions offers it; it is typed and stable since watchfiles 0.10.
from watchfiles._rust_notify import RustNotify

DEBOUNCE_MS = 50
STEP_MS = 20  # the watch thread wakes this often: cancellation latency vs idle cost

#: A batch of changes: (watchfiles.Change value, path) pairs.
Changes = set[tuple[int, str]]


class DirWatch:
    """Watches one directory (not its subdirectories) through watchfiles' inotify backend.

    The watch starts at construction, so nothing that happens after it is
    missed; leaving the `with` block closes it. While a batch is awaited, one
    worker thread waits for it (on its own limiter, so many watches do not use
    up anyio's shared thread tokens) and the notify crate runs a reader thread.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._notify = RustNotify([directory], False, False, 0, False, False)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._notify.close()

    async def next_batch(self) -> Changes:
        """Return the next debounced batch of changes; cancelling stops the worker thread."""
        stop = threading.Event()
        done = anyio.Event()
        outcome: list[Changes | str | Exception] = []

        async def run() -> None:
            # A thread call cannot be interrupted, so cancellation reaches it through `stop`.
            try:
                outcome.append(
                    await anyio.to_thread.run_sync(
                        self._notify.watch,
                        DEBOUNCE_MS,
                        STEP_MS,
                        0,
                        stop,
                        limiter=anyio.CapacityLimiter(1),
                    )
                )
            except Exception as e:  # noqa: BLE001 - re-raised below, outside the task group
                outcome.append(e)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                await done.wait()
            finally:
                stop.set()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0] if isinstance(outcome[0], set) else set()
