"""FileWatch: a Wait case that fires on a file event, seen through inotify (watchfiles).

It keeps one non-recursive inotify watch on the directory that holds the path
(for `nonempty`, on the directory itself). While that directory is missing it
watches the nearest existing ancestor and moves down as directories appear,
like systemd's .path units.

- `exists`, `nonempty` are levels: checked as soon as the watch is armed (so
  they fire at once when already true, also after a restart) and after every
  batch of changes. Only `exists` takes a glob, in the last path component.
- `created`, `deleted`, `modified` are edges, fired by that change for the
  exact path. `modified` is any write, a replace by rename, or a metadata
  change (chmod, touch): watchfiles does not tell them apart, and it reports
  writes, not "write closed", so it fires after the first burst of writes
  (debounced ~50 ms). Writers that need the watcher to see a complete file
  should write a temp file and rename it into place.
- setup records the file's identity (inode, size, mtime), so an edge that
  happened before listen started, or while the daemon was down, still fires
  when listen starts (`modified`: the file differs from the one at setup).
- a watch that fails to re-arm after a restart (the inotify limits) becomes a setup
  error; the setup that retries it keeps the identity recorded the first time.
- setup adds the directory to the daemon's one inotify instance (see
  `_dirwatch.Hub`): a directory that cannot be watched (the per-user inotify
  limits, permissions) fails the setup, so the wait shows the error and is
  set up again with backoff, like any failed setup. A listen costs no thread.

The input delivered is `{"path": matched path, "change": on}`.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import msgspec
from watchfiles import Change

from daemon.core.handler import CallbackRequest, Deliver

from ._dirwatch import Changes, hub

_ON = ("created", "modified", "deleted", "exists", "nonempty")
_MAGIC = re.compile(r"[*?[]")


class _Spec(msgspec.Struct):
    path: str
    on: str
    seen: list[int] | None = None


class FileWatch:
    """Fires when `path` is created, modified, deleted, exists, or (a directory) is nonempty."""

    type = "file"

    def __init__(self, path: str | os.PathLike[str], on: str = "created") -> None:
        if on not in _ON:
            raise ValueError(f"FileWatch(on=) must be one of {', '.join(_ON)}, not {on!r}")
        self.path = os.fspath(path)
        if _MAGIC.search(self.path) and on != "exists":
            raise ValueError(f"only on='exists' accepts a glob: {self.path!r}")
        if _MAGIC.search(os.path.dirname(self.path)):
            raise ValueError(f"a glob may only be in the last path component: {self.path!r}")
        self.on = on

    async def setup(self, req: CallbackRequest) -> str:
        """Watch the directory; store the absolute path, the condition and the file's identity.

        Raises WatchFailed (an OSError) if the directory cannot be watched. Set up again
        (its watch failed to re-arm after a restart), it keeps the identity seen first, so a
        change made meanwhile still fires.
        """
        spec = _spec(self.path, self.on)
        try:
            was = msgspec.json.decode(req.setup_data, type=_Spec) if req.setup_data else None
        except msgspec.MsgspecError:
            was = None
        if was is not None and (was.path, was.on) == (spec.path, spec.on):
            spec.seen = was.seen
        for attempt in range(3):
            try:
                await hub().add(_root(spec))
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
                # The directory vanished between the check and the watch: look again.
        return msgspec.json.encode(spec).decode()

    async def listen(self, req: CallbackRequest, deliver: Deliver) -> None:
        """Wait for the condition, then deliver it; cancelling closes the watch."""
        spec = msgspec.json.decode(req.setup_data, type=_Spec)
        await deliver({"path": await _wait(spec), "change": spec.on})

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Return the input: `{"path": ..., "change": ...}`."""
        return input

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Do nothing: the watch lives only inside `listen`."""


def _spec(path: str, on: str) -> _Spec:
    """Return what setup stores: the absolute path, the condition and the file's identity."""
    path = os.path.abspath(path)
    return _Spec(path, on, _identity(path))


def _identity(path: str) -> list[int] | None:
    """Return what tells one version of a file from another, or None if it is absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _root(spec: _Spec) -> str:
    """Return the existing directory to watch for this condition."""
    on_itself = spec.on == "nonempty" and os.path.isdir(spec.path)
    directory = spec.path if on_itself else os.path.dirname(spec.path)
    while not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    return directory


def _level(spec: _Spec) -> str | None:
    """Return the matching path if the level condition holds now."""
    if spec.on == "nonempty":
        try:
            with os.scandir(spec.path) as entries:
                return spec.path if next(entries, None) is not None else None
        except OSError:
            return None
    if _MAGIC.search(spec.path):
        return min(glob.glob(spec.path), default=None)
    return spec.path if os.path.exists(spec.path) else None


def _on_arm(spec: _Spec) -> str | None:
    """Check the condition right after the watch is armed, against the file seen at setup."""
    if spec.on in ("exists", "nonempty"):
        return _level(spec)
    now, was = _identity(spec.path), spec.seen
    fired = {
        "created": now is not None and (was is None or now[0] != was[0]),
        "deleted": was is not None and (now is None or now[0] != was[0]),
        "modified": now is not None and now != was,
    }[spec.on]
    return spec.path if fired else None


def _on_changes(spec: _Spec, changes: Changes) -> str | None:
    """Check the condition after a batch of changes."""
    if spec.on in ("exists", "nonempty"):
        return _level(spec)
    kinds = {Change(kind) for kind, path in changes if path == spec.path}
    fired = {
        "created": Change.added in kinds,
        "deleted": Change.deleted in kinds,
        "modified": bool(kinds - {Change.deleted}) and os.path.exists(spec.path),
    }[spec.on]
    return spec.path if fired else None


async def _wait(spec: _Spec) -> str:
    """Watch until the condition holds and return the matching path."""
    shared = hub()
    while True:
        root = _root(spec)
        hit = None
        try:
            async with shared.watching(root) as watch:
                hit = _on_arm(spec)
                while hit is None:
                    changes = await watch.next_batch()
                    hit = _on_changes(spec, changes)
                    # A root that was removed or renamed, or a missing directory that
                    # appeared, needs a new watch (inode numbers are reused: compare paths).
                    if any(path == root for _, path in changes) or _root(spec) != root:
                        break
        except FileNotFoundError:
            continue  # the root vanished between the check and the watch
        if hit is not None:
            return hit
