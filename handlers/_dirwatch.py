"""The daemon's one inotify instance, shared by every FileWatch: directories in, changes out.

Design. watchfiles' RustNotify is one inotify instance watching the paths it was built with;
it cannot add a path later. So a `Hub` (one per event loop, that is one per daemon) keeps
one RustNotify over every directory any FileWatch needs, and builds a new one, over the new
set, when a directory is added. The new instance is running before the old one is retired,
and the old one hands over what it still holds before it closes, so no change is lost in
between; the copies seen by both are harmless (FileWatch re-checks the file system). A
reader thread per instance (one at a time, briefly two) waits for batches of changes and
passes them to the event loop, which hands each change to the subscribers of its
directory. Directories nobody watches any more stay in the instance until a build drops
them, in bulk, once they outnumber the live ones; when nobody watches anything, the
instance is closed (the next watch builds one).

Why: an inotify instance per watch hits the per-user instance limit
(fs.inotify.max_user_instances, 128 by default) at a few dozen workflows, and each of those
watches cost two threads. Here the daemon needs one instance (two while it switches), and a
directory that cannot be watched (the limit, permissions) raises `WatchFailed` to the one
that asked, so FileWatch's setup fails as a setup error: shown, logged and retried.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from anyio.lowlevel import RunVar

# watchfiles' public `watch`/`awatch` open the inotify watch only when first iterated, and
# block there; the class behind them lets us build the watch first and read it from a thread
# of our own. It is typed and stable since watchfiles 0.10.
from watchfiles._rust_notify import RustNotify

DEBOUNCE_MS = 50
STEP_MS = 20  # the reader thread wakes this often while changes come in
IDLE_MS = 100  # ...and returns this often when idle: how soon a retired instance closes
#: Keep directories no one watches in the instance until they outnumber the live ones so.
STALE_KEPT = 64

#: A batch of changes: (watchfiles.Change value, path) pairs.
Changes = set[tuple[int, str]]
_MODIFIED, _DELETED = 2, 3  # watchfiles.Change values
#: Errors of the whole instance, not of one directory: EMFILE, ENFILE, ENOSPC.
_LIMITS = {
    "os error 24": "the per-user inotify instance limit (fs.inotify.max_user_instances)",
    "os error 23": "the system's open file limit",
    "os error 28": "the per-user inotify watch limit (fs.inotify.max_user_watches)",
    "MaxFilesWatch": "the per-user inotify watch limit (fs.inotify.max_user_watches)",
}


class WatchFailed(OSError):
    """A directory could not be added to the daemon's inotify instance."""


def _failure(directory: str, e: BaseException) -> OSError:
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(f"no directory {directory}")  # the caller looks again
    text = str(e)
    hint = next((h for key, h in _LIMITS.items() if key in text), None)
    return WatchFailed(
        f"cannot watch {directory}: {text}" + (f" ({hint} is reached)" if hint else "")
    )


class Subscription:
    """The changes in one directory (and to the directory itself) since it was subscribed."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._changes: Changes = set()
        self._ready = asyncio.Event()

    def push(self, change: int, path: str) -> None:
        """Add one change (called in the event loop)."""
        self._changes.add((change, path))
        self._ready.set()

    async def next_batch(self) -> Changes:
        """Return the changes since the last batch, waiting for one if there are none."""
        await self._ready.wait()
        self._ready.clear()
        batch, self._changes = self._changes, set()
        return batch


class _Reader:
    """Reads one RustNotify in a thread of its own and passes each batch to the loop.

    `retire()` lets it hand over what it still holds, then close (a newer instance took
    over); `close()` closes it at once (nobody watches any more).
    """

    def __init__(
        self,
        notify: RustNotify,
        dirs: frozenset[str],
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[_Reader, Changes | Exception], None],
    ) -> None:
        self.notify, self.dirs, self._loop, self._deliver = notify, dirs, loop, deliver
        self._retired = self._closed = False
        thread = threading.Thread(target=self._run, name="workflowd-filewatch", daemon=True)
        thread.start()

    def retire(self) -> None:
        """Hand over the changes still held, then close."""
        self._retired = True

    def close(self) -> None:
        """Close within STEP_MS, dropping what is held."""
        self._closed = True

    def is_set(self) -> bool:
        """Tell watch() to stop (it asks every STEP_MS): closed, or the loop is gone."""
        return self._closed or self._loop.is_closed()

    def _run(self) -> None:
        try:
            while True:
                draining = self._retired
                got = self.notify.watch(
                    DEBOUNCE_MS, STEP_MS, 2 * STEP_MS if draining else IDLE_MS, self
                )
                if isinstance(got, set) and got:
                    self._hand(got)
                if got == "stop" or draining:
                    return
        except Exception as e:  # noqa: BLE001 - the loop learns of it: its watches are lost
            self._hand(e)
        finally:
            self.notify.close()

    def _hand(self, item: Changes | Exception) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, self, item)
        except RuntimeError:
            self._closed = True  # the loop is closed: nobody to tell


class Hub:
    """One inotify instance for every directory watched in this event loop (see the module)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._subs: dict[str, set[Subscription]] = {}
        self._reader: _Reader | None = None
        #: The directories the current instance watches (a removed one is dropped at once).
        self._watched: frozenset[str] = frozenset()
        self._wanted: set[str] = set()
        self._errors: dict[str, OSError] = {}
        self._lock = anyio.Lock()

    def watched(self, directory: str) -> bool:
        """Tell whether the instance watches `directory` now."""
        return directory in self._watched

    def subscribers(self, directory: str | None = None) -> int:
        """Count the subscriptions to `directory`, or to any directory."""
        if directory is None:
            return sum(len(subs) for subs in self._subs.values())
        return len(self._subs.get(directory, ()))

    async def add(self, directory: str) -> None:
        """Make the instance watch `directory`; raise WatchFailed if it cannot.

        A directory that is gone raises FileNotFoundError.
        """
        if directory in self._watched:
            return
        self._wanted.add(directory)
        async with self._lock:
            # Whoever holds the lock builds for every directory asked for meanwhile.
            if directory not in self._watched and (
                directory in self._wanted or directory not in self._errors
            ):
                await self._build()
            if directory not in self._watched:
                raise self._errors.get(directory) or _failure(directory, OSError("not watched"))

    @asynccontextmanager
    async def watching(self, directory: str) -> AsyncIterator[Subscription]:
        """Subscribe to the changes in `directory` for the block; raise WatchFailed if it cannot."""
        sub = Subscription(directory)
        self._subs.setdefault(directory, set()).add(sub)  # first, so nothing is missed
        try:
            await self.add(directory)
            yield sub
        finally:
            subs = self._subs[directory]
            subs.discard(sub)
            if not subs:
                del self._subs[directory]
                if not self._subs and self._reader is not None:
                    # Nobody watches: give the instance back (the next add builds one).
                    self._reader.close()
                    self._reader, self._watched = None, frozenset()

    async def _build(self) -> None:
        new, self._wanted = self._wanted, set()
        self._errors = {}
        live = set(self._subs)
        kept = self._watched if len(self._watched - live) <= max(STALE_KEPT, len(live)) else live
        built, dirs, errors = await anyio.to_thread.run_sync(_make, {*kept, *live, *new}, new)
        self._errors = {d: _failure(d, e) for d, e in errors.items()}
        if built is None:
            return
        old, self._reader = self._reader, _Reader(built, frozenset(dirs), self._loop, self._deliver)
        lost = (self._watched | live) - dirs
        self._watched = frozenset(dirs)
        if old is not None:
            old.retire()
        for d in lost:  # left out (gone, refused): their subscribers must watch anew
            for sub in self._subs.get(d, ()):
                sub.push(_DELETED, d)

    def _deliver(self, reader: _Reader, item: Changes | Exception) -> None:
        """Hand a reader's batch to the subscribers (runs in the event loop)."""
        current = reader is self._reader
        if isinstance(item, Exception):
            if not current:
                return
            # The instance broke: tell every subscriber its directory changed, so each
            # watches anew (and the next add builds a new instance).
            self._reader, self._watched = None, frozenset()
            item = {(_DELETED, d) for d in reader.dirs}
        for change, path in item:
            if current and change != _MODIFIED and path in self._watched:
                # The directory itself was removed, replaced or moved: that watch is dead.
                self._watched = self._watched - {path}
            for directory in (path, os.path.dirname(path)):
                for sub in self._subs.get(directory, ()):
                    sub.push(change, path)


def _make(
    target: set[str], new: set[str]
) -> tuple[RustNotify | None, set[str], dict[str, BaseException]]:
    """Build an instance over the directories of `target` (in a worker thread).

    A directory that is gone or refused (watchfiles' error names it) is left out and its
    error returned; an error naming none (a limit) is blamed on the directories of `new`
    and builds nothing (None): the instance there is keeps working. Return the instance,
    the directories it watches, and the errors by directory.
    """
    errors: dict[str, BaseException] = {}
    for d in [d for d in target if not os.path.isdir(d)]:
        target.discard(d)
        errors[d] = FileNotFoundError(f"no directory {d}")
    while True:
        try:
            return _notify(target), target, errors
        except Exception as e:  # noqa: BLE001 - an error of one directory, or of them all
            culprit = _culprit(e)
            if culprit not in target:
                return None, target, {**errors, **dict.fromkeys(new & target, e)}
            target.discard(culprit)
            errors[culprit] = e


def _culprit(e: BaseException) -> str | None:
    """Return the directory a watchfiles error is about (`... about ["/path"]`), if any."""
    found = re.search(r'about \["(.+?)"\]', str(e))
    return found.group(1) if found else None


def _notify(dirs: set[str]) -> RustNotify:
    return RustNotify(sorted(dirs), False, False, 0, False, False)


_HUB: RunVar[Hub] = RunVar("workflowd_filewatch_hub")


def hub() -> Hub:
    """Return this event loop's hub, made on first use."""
    try:
        return _HUB.get()
    except LookupError:
        made = Hub()
        _HUB.set(made)
        return made
