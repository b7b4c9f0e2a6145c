"""The `backup` op: a consistent copy of the database, only into `[store] backup_dir`.

A client names the backup, never a path: the daemon may run as root, and a path of the
client's choice would let it make the daemon create or replace files anywhere.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from daemon.errors import BadRequest, Conflict, Unavailable
from daemon.store.base import Store

log = structlog.get_logger()

#: A backup file's name: the client's name plus this (unless it already ends so).
SUFFIX = ".db"
MAX_NAME = 200
FOLDER_MODE = 0o700
#: Temporary files of a backup that died with the daemon are removed after this.
STALE_TMP_S = 86400.0


@dataclass(frozen=True)
class BackupPolicy:
    """Where backups go and what they may use: `[store] backup_dir`, `backup_keep`, `min_free_bytes`."""

    dir: Path
    keep: int = 7
    min_free_bytes: int = 64 << 20


def file_name(name: str) -> str:
    """Return the file a backup called `name` is written to; raise BadRequest if it is no plain name."""
    if not name:
        raise BadRequest("field `name` must not be empty")
    if len(name) > MAX_NAME:
        raise BadRequest(f"field `name` is longer than {MAX_NAME} characters")
    if "/" in name or ".." in name or name.startswith("."):
        raise BadRequest(
            f"field `name` must be a plain file name (no '/', no '..', no leading dot): {name!r}"
        )
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        raise BadRequest(f"field `name` must not hold control characters: {name!r}")
    return name if name.endswith(SUFFIX) else name + SUFFIX


class Backups:
    """Writes backups one at a time into the policy's folder and keeps the newest few."""

    def __init__(self, *, store: Store, policy: Callable[[], BackupPolicy]) -> None:
        self._store, self._policy = store, policy
        self._lock = anyio.Lock()  # two at once would each count the free space the other needs

    async def backup(self, name: str) -> dict[str, Any]:
        """Copy the database to `<backup_dir>/<name>.db`; return where, its size and what was pruned."""
        file = file_name(name)
        policy = self._policy()
        async with self._lock:
            with _open_folder(policy.dir) as dfd:
                await anyio.to_thread.run_sync(_check_space, dfd, self._store.path, policy)
                # Through our descriptor of the folder we checked, whatever its path names now.
                via = Path(f"/proc/self/fd/{dfd}")
                try:
                    size = await self._store.backup(via / file)
                except Conflict:
                    raise Conflict(f"{policy.dir / file} exists; pick a new name") from None
                except BadRequest as e:  # the name was fine: the disk or the folder failed
                    raise Unavailable(str(e).replace(str(via), str(policy.dir))) from None
                deleted = await anyio.to_thread.run_sync(
                    _prune, dfd, file, policy.keep, self._store.path
                )
        path = policy.dir / file
        log.info("backup_written", path=str(path), bytes=size, deleted=deleted)
        return {"name": file, "path": str(path), "bytes": size, "deleted": deleted}


@contextlib.contextmanager
def _open_folder(folder: Path) -> Iterator[int]:
    """Open (creating it 0700) the backup folder; refuse one others could write to or swap."""
    try:
        created = not os.path.lexists(folder)
        os.makedirs(folder, mode=FOLDER_MODE, exist_ok=True)
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise Unavailable(f"cannot open the backup folder {folder}: {e.strerror or e}") from None
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid():
            raise Unavailable(
                f"the backup folder {folder} belongs to uid {st.st_uid}, not to the daemon's"
                f" ({os.geteuid()}); chown it or set [store] backup_dir"
            )
        if st.st_mode & 0o022:
            raise Unavailable(
                f"the backup folder {folder} is writable by others (mode"
                f" {stat.S_IMODE(st.st_mode):04o}); chmod 0700 it"
            )
        if created:
            os.fchmod(dfd, FOLDER_MODE)  # the umask may have taken our own bits from it
        yield dfd
    finally:
        os.close(dfd)


def _check_space(dfd: int, db: Path, policy: BackupPolicy) -> None:
    """Refuse a backup that would leave less than `min_free_bytes` free on the folder's disk."""
    need = 0
    for part in (db, db.with_name(db.name + "-wal")):
        with contextlib.suppress(FileNotFoundError):
            need += os.stat(part).st_size  # the copy is at most the database and its WAL
    vfs = os.fstatvfs(dfd)
    free = vfs.f_bavail * vfs.f_frsize
    if free - need < policy.min_free_bytes:
        log.warning("backup_refused", folder=str(policy.dir), free=free, needs=need)
        raise Unavailable(
            f"backup refused: {free} bytes free in {policy.dir}, the copy needs up to {need}, and"
            f" [store] min_free_bytes = {policy.min_free_bytes} must stay free"
        )


def _prune(dfd: int, written: str, keep: int, db: Path) -> list[str]:
    """Delete the oldest backups beyond `keep` (never `written`), and dead temporary files."""
    backups: list[tuple[int, str]] = []
    now = time.time()
    try:
        live = os.stat(db)
        spare = {(live.st_dev, live.st_ino)}  # the database itself, should it be linked in here
    except FileNotFoundError:
        spare = set()
    with os.scandir(dfd) as entries:
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in spare:
                continue  # links and folders are nobody's backup: left alone
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TMP_S:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=dfd)
            elif entry.name.endswith(SUFFIX) and entry.name != written:
                backups.append((st.st_mtime_ns, entry.name))
    backups.sort()
    doomed = [name for _, name in backups[: max(0, len(backups) + 1 - keep)]]
    for name in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
    return doomed
