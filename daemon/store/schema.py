"""The SQLite file: schema migrations, row types, SQL text, locking and opening connections."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import msgspec
import structlog

from daemon.core.state import FINAL_STATUSES
from daemon.errors import BadRequest, ConfigError, Conflict, StoreLocked, StoreUnusable

log = structlog.get_logger(__name__)

FINAL = tuple(sorted(s.value for s in FINAL_STATUSES))
SYNCHRONOUS = {"normal": "NORMAL", "full": "FULL"}
COLS = (
    "id, name, status, data, state, error, attempt, next_run_at, created_at, updated_at,"
    " parent, deadline"
)
FINAL_ROWS = "status IN (?, ?, ?) AND updated_at < ?"
#: Workflow data is the daemon's alone: a state folder it creates, and every file of the
#: database (and its backups), get these modes whatever the umask.
FOLDER_MODE, FILE_MODE = 0o700, 0o600

#: MIGRATIONS[n] takes the schema from version n to n + 1; append new ones, never edit old ones.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE workflows (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, status TEXT NOT NULL,
        data TEXT NOT NULL, state TEXT NOT NULL, error TEXT,
        attempt INTEGER NOT NULL DEFAULT 0, next_run_at REAL,
        created_at REAL NOT NULL, updated_at REAL NOT NULL,
        history_seq INTEGER NOT NULL DEFAULT 0  -- per-workflow counter: makes retention a range delete
    );
    CREATE INDEX workflows_status ON workflows (status);
    CREATE TABLE history (
        id INTEGER PRIMARY KEY, workflow_id TEXT NOT NULL, seq INTEGER NOT NULL,
        at REAL NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL
    );
    CREATE INDEX history_workflow ON history (workflow_id, seq);
    CREATE TABLE inbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT, workflow_id TEXT NOT NULL, event TEXT NOT NULL,
        thread_id TEXT NOT NULL, pc INTEGER NOT NULL, input TEXT NOT NULL, created_at REAL NOT NULL
    );
    CREATE INDEX inbox_workflow ON inbox (workflow_id);
    """,
    """
    CREATE TABLE schedules (
        name TEXT PRIMARY KEY,
        last_nominal REAL NOT NULL,  -- every nominal time up to this one is handled (fired or given up)
        paused INTEGER NOT NULL DEFAULT 0,
        buffered REAL,  -- a nominal time held back until the running workflow ends (buffer_one)
        last_workflow_id TEXT, last_fire_at REAL,
        fire_seq INTEGER NOT NULL DEFAULT 0,  -- per-schedule counter: keeps the last fires by a range delete
        created_at REAL NOT NULL
    );
    CREATE TABLE schedule_fires (
        schedule TEXT NOT NULL, seq INTEGER NOT NULL, at REAL NOT NULL, kind TEXT NOT NULL,
        nominal REAL, workflow_id TEXT, reason TEXT, count INTEGER NOT NULL DEFAULT 1,
        PRIMARY KEY (schedule, seq)
    );
    """,
    # Hooks: the end of a workflow (Failed, Finished) queues one row in the transaction that
    # commits it, so a crash can neither lose it nor (with `started_at`) run its hook twice.
    """
    CREATE TABLE hook_runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the key of one ending: never reused
        workflow_id TEXT NOT NULL, workflow TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
        at REAL NOT NULL,
        started_at REAL  -- committed before the hook runs: a restart never runs it again
    );
    CREATE TRIGGER hook_on_end AFTER UPDATE OF status ON workflows
    WHEN NEW.status IN ('Failed', 'Finished') AND NEW.status IS NOT OLD.status
    BEGIN
        INSERT INTO hook_runs (workflow_id, workflow, status, error, at)
        VALUES (NEW.id, NEW.name, NEW.status, NEW.error, NEW.updated_at);
    END;
    """,
    # Child workflows and deadlines (issue 19): who started a workflow, and when it is cancelled.
    """
    ALTER TABLE workflows ADD COLUMN parent TEXT;  -- the workflow whose Child case started it
    ALTER TABLE workflows ADD COLUMN deadline REAL;  -- epoch seconds: cancelled past it (timeout_s)
    CREATE INDEX workflows_parent ON workflows (parent) WHERE parent IS NOT NULL;
    """,
    # `list` pages newest first by (updated_at, rowid), filtered by status or type or neither:
    # each filter reads its own index in order, with no sort. The status index is covered.
    """
    CREATE INDEX workflows_updated ON workflows (updated_at);
    CREATE INDEX workflows_status_updated ON workflows (status, updated_at);
    CREATE INDEX workflows_name_updated ON workflows (name, updated_at);
    DROP INDEX workflows_status;
    """,
    # Schedules (issue 15): a large instant's fires are committed ahead of it; their workflows
    # run from this time on, not before (the runtime's release and recovery both honour it).
    """
    ALTER TABLE workflows ADD COLUMN not_before REAL;  -- epoch seconds: not run before it
    """,
]


def list_query(
    status: str | None,
    name: str | None,
    after: tuple[float, int] | None,
    parent: str | None = None,
) -> tuple[str, list[Any]]:
    """Return `list`'s SQL, which wants its LIMIT as the last parameter, and the others.

    Rows come newest first, by (updated_at, rowid): the order each list index keeps, so a page
    is read from the index in order and never sorted; a page goes on strictly after `after`.
    """
    where: list[str] = []
    params: list[Any] = []
    for clause, value in (("status = ?", status), ("name = ?", name), ("parent = ?", parent)):
        if value is not None:
            where.append(clause)
            params.append(value)
    if after is not None:
        where.append("(updated_at, rowid) < (?, ?)")
        params += after
    # The position of a row (for the next page's `after`) comes last: (updated_at, rowid).
    sql = f"SELECT {COLS}, updated_at, rowid FROM workflows"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql + " ORDER BY updated_at DESC, rowid DESC LIMIT ?", params


INSERT_WORKFLOW = (
    f"INSERT INTO workflows ({COLS}, history_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (id) DO NOTHING"
)
CHECKPOINT = (
    "UPDATE workflows SET status = ?, data = ?, state = ?, error = ?, attempt = ?, next_run_at = ?,"
    " updated_at = ?, history_seq = history_seq + ? WHERE id = ? RETURNING history_seq"
)
SET_STATUS = (
    "UPDATE workflows SET status = ?, error = ?, attempt = COALESCE(?, attempt), next_run_at = ?,"
    " updated_at = ?, history_seq = history_seq + ? WHERE id = ? RETURNING history_seq"
)
ADD_HISTORY = (
    "UPDATE workflows SET history_seq = history_seq + ? WHERE id = ? RETURNING history_seq"
)
#: A checkpoint's common case (one history entry or none, no inbox rows) as one statement:
#: an INSERT into this view runs the UPDATE, the history row and its trim in the trigger,
#: so the writer thread makes one call per checkpoint (one per batch with executemany) and,
#: for a lone one, no BEGIN and COMMIT either (the statement is its own transaction).
#: TEMP: made on the writer's connection each time it opens; nothing of it is stored.
#: A workflow that is not there raises MISSING, and the statement changes nothing.
MISSING = "workflowd: no such workflow"
INSERT_CHECKPOINT = "INSERT INTO temp.wd_checkpoint VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


#: The trigger trims a workflow's history each time its counter reaches a multiple of this,
#: not on every row: a trim dirties the pages of the oldest rows (two more pages for the
#: commit to write), so that cost is shared by this many checkpoints. Reads show `keep` rows.
HISTORY_TRIM_EVERY = 16


def checkpoint_view(keep: int) -> str:
    """Return the script that makes INSERT_CHECKPOINT's view, keeping `keep` history rows.

    Between trims, up to HISTORY_TRIM_EVERY - 1 rows past `keep` are left to the next one.
    """
    return f"""
    CREATE TEMP VIEW wd_checkpoint (
        id, status, data, state, error, attempt, next_run_at, updated_at, n, kind, detail
    ) AS SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE 0;
    CREATE TEMP TRIGGER wd_checkpoint_apply INSTEAD OF INSERT ON wd_checkpoint BEGIN
        UPDATE workflows SET status = NEW.status, data = NEW.data, state = NEW.state,
            error = NEW.error, attempt = NEW.attempt, next_run_at = NEW.next_run_at,
            updated_at = NEW.updated_at, history_seq = history_seq + NEW.n
        WHERE id = NEW.id;
        SELECT RAISE(ABORT, '{MISSING}') WHERE changes() = 0;
        INSERT INTO history (workflow_id, seq, at, kind, detail)
            SELECT NEW.id, history_seq, NEW.updated_at, NEW.kind, NEW.detail
            FROM workflows WHERE NEW.n AND id = NEW.id;
        DELETE FROM history WHERE NEW.n AND workflow_id = NEW.id
            AND seq <= (SELECT history_seq - {int(keep)} FROM workflows WHERE id = NEW.id
                AND history_seq % {HISTORY_TRIM_EVERY} < NEW.n);
    END;
    """


INSERT_HISTORY = "INSERT INTO history (workflow_id, seq, at, kind, detail) VALUES (?, ?, ?, ?, ?)"
TRIM_HISTORY = "DELETE FROM history WHERE workflow_id = ? AND seq <= ?"
SCHEDULE_COLS = "name, last_nominal, paused, buffered, last_workflow_id, last_fire_at"
#: Fires (and skips) kept per schedule for `workflowctl schedule show`.
FIRES_KEPT = 100
ADD_SCHEDULE = (
    "INSERT INTO schedules (name, last_nominal, created_at) VALUES (?, ?, ?)"
    " ON CONFLICT (name) DO NOTHING"
)
INSERT_FIRE = (
    "INSERT INTO schedule_fires (schedule, seq, at, kind, nominal, workflow_id, reason, count)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
TRIM_FIRES = "DELETE FROM schedule_fires WHERE schedule = ? AND seq <= ?"

_encoder = msgspec.json.Encoder()
Entries = Sequence[tuple[float, str, str]]


def to_json(value: Any) -> str:
    return _encoder.encode(value).decode()


def detail_of(text: str) -> dict[str, Any]:
    """Decode a history detail; a corrupt one is shown as its text rather than failing."""
    try:
        detail = msgspec.json.decode(text)
    except msgspec.DecodeError as e:
        return {"corrupt": text, "error": str(e)}
    return detail if isinstance(detail, dict) else {"value": detail}


def unusable(action: str, path: Path, e: OSError) -> StoreUnusable:
    """Return the start-up error for an OS error on `path`: one line, with the errno."""
    name = errno.errorcode.get(e.errno or 0, "?")
    return StoreUnusable(f"cannot {action} {path}: [Errno {e.errno}] {e.strerror} ({name})")


def make_folder(folder: Path) -> None:
    """Create the state folder with FOLDER_MODE; an existing folder is the operator's, as is."""
    if folder.is_dir():
        return
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(FOLDER_MODE)
        os.chmod(folder, FOLDER_MODE)  # mkdir's mode is cut by the umask
    except FileExistsError:
        if not folder.is_dir():
            raise StoreUnusable(f"cannot create {folder}: it exists and is not a folder") from None
    except OSError as e:
        raise unusable("create", folder, e) from None


def _private(fd: int, path: Path) -> None:
    """Give an open file of ours FILE_MODE (a file made by an older version may be looser)."""
    mode = os.fstat(fd).st_mode & 0o7777
    if mode != FILE_MODE:
        try:
            os.fchmod(fd, FILE_MODE)
        except PermissionError:
            log.warning("store_file_mode", path=str(path), mode=oct(mode), note="not our file")


def open_private(path: Path, flags: int) -> int:
    """Open `path` (O_RDWR plus `flags`), made FILE_MODE; raise StoreUnusable if it refuses.

    A missing file raises FileNotFoundError as is, unless `flags` hold O_CREAT.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | flags, FILE_MODE)
    except FileNotFoundError as e:
        if not flags & os.O_CREAT:
            raise
        raise unusable("create", path, e) from None
    except OSError as e:
        raise unusable("write", path, e) from None
    try:
        _private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_files(db: Path) -> None:
    """Make the database's files private and check each one, and the folder, can be written.

    The database is created here if it is missing, with FILE_MODE: SQLite gives the -wal
    and -shm files it creates the database's mode, so those stay private too. Every
    check opens for writing, so the first file that refuses (read-only, immutable, on a
    read-only mount, not ours) is named with its errno before the daemon reports READY,
    instead of the first write failing after it.
    """
    os.close(open_private(db, os.O_CREAT))
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.close(open_private(db.with_name(db.name + suffix), 0))
    # SQLite creates -wal and -shm in the folder. We hold the lock, so this name is ours.
    probe = db.with_name(f".{db.name}.probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE))
        os.unlink(probe)
    except OSError as e:
        raise unusable("create files in", db.parent, e) from None


@contextlib.contextmanager
def exclusive_lock(db: Path) -> Iterator[None]:
    lock = db.with_name(db.name + ".lock")
    fd = open_private(lock, os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLocked(f"another workflowd holds {db} (lock {lock})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


async def connect(
    stack: contextlib.AsyncExitStack, path: Path, pragmas: str
) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, isolation_level=None)

    async def close() -> None:
        with anyio.CancelScope(shield=True):
            await conn.close()

    stack.push_async_callback(close)
    await conn.executescript(pragmas)
    return conn


async def migrate(conn: aiosqlite.Connection, path: Path) -> None:
    (version,) = next(iter(await conn.execute_fetchall("PRAGMA user_version")))
    if version > len(MIGRATIONS):
        raise ConfigError(
            f"{path} has schema version {version}; this workflowd knows {len(MIGRATIONS)}"
        )
    for v in range(version, len(MIGRATIONS)):
        try:
            await conn.executescript(
                f"BEGIN IMMEDIATE; {MIGRATIONS[v]}; PRAGMA user_version = {v + 1}; COMMIT;"
            )
        except BaseException:
            await conn.rollback()
            raise


def backup_file(src_path: Path, dest: Path) -> int:
    """Copy the database at `src_path` to the new file `dest`; return its size.

    The copy is written under an unguessable temporary name opened with O_EXCL|O_NOFOLLOW
    (so no planted file or link is followed), and is linked into place only if that name still
    holds the file we opened: `dest` is complete or absent, and nothing existing is replaced.
    """
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        # Made private before SQLite opens it, so the copy is never readable by others.
        fd = os.open(tmp, flags, FILE_MODE)
    except OSError as e:
        raise BadRequest(f"cannot write {dest}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, FILE_MODE)
        src = sqlite3.connect(src_path)
        try:
            dst = sqlite3.connect(tmp)
            try:
                src.backup(dst)
                # A self-contained file: no -wal beside it to copy along.
                dst.execute("PRAGMA journal_mode = DELETE")
            finally:
                dst.close()
        finally:
            src.close()
        ours, now = os.fstat(fd), os.lstat(tmp)
        if (now.st_dev, now.st_ino) != (ours.st_dev, ours.st_ino):
            raise BadRequest(f"cannot write {dest}: its temporary file was replaced")
        # linkat without AT_SYMLINK_FOLLOW: links the file itself and never replaces `dest`.
        os.link(tmp, dest, follow_symlinks=False)
        return ours.st_size
    except FileExistsError:
        raise Conflict(f"{dest} exists; pick a new name") from None
    except (OSError, sqlite3.Error) as e:
        raise BadRequest(f"cannot write {dest}: {e}") from None
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
