"""The control socket's file and peers: bind without stealing, socket activation, credentials."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import os
import socket
import stat
import struct
from pathlib import Path

import anyio
import anyio.abc
import structlog

from daemon.errors import ConfigError, Unavailable

log = structlog.get_logger()

#: Connections the kernel queues before we accept them: a cron of hundreds of clients at one
#: second must not meet EAGAIN at connect (the kernel caps it at net.core.somaxconn).
BACKLOG = 1024


async def listener_from_systemd(fd: int = 3) -> anyio.abc.SocketListener | None:
    """Return the listening socket systemd passed us (socket activation), or None."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    count = os.environ.get("LISTEN_FDS", "")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # so that our children do not think the socket is theirs
    if not count.isdigit() or int(count) < 1:
        return None
    return await anyio.abc.SocketListener.from_socket(socket.socket(fileno=fd))


def group_id(group: int | str) -> int:
    """Resolve a group name or gid to a gid."""
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"unknown group {group!r} in the control socket's allowed groups"
        ) from None


async def bind(
    path: Path, mode: int, group: int | None = None
) -> tuple[anyio.abc.SocketListener, os.stat_result]:
    """Bind and listen at `path` with `mode` (and `group`), replacing a stale socket, never a live one."""
    await _remove_stale(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(str(path))
        except OSError as e:
            raise Unavailable(f"cannot bind {path}: {e}") from None
        # Nobody can connect before listen(), so the mode is right before the first client.
        os.chmod(path, mode)
        if group is not None:
            try:
                os.chown(path, -1, group)
            except OSError as e:
                os.unlink(path)
                raise ConfigError(
                    f"cannot give {path} to [daemon] socket_group {group}: {e.strerror or e}"
                ) from None
        created = os.stat(path)
        sock.listen(BACKLOG)
        return await anyio.abc.SocketListener.from_socket(sock), created
    except BaseException:
        sock.close()
        raise


async def _remove_stale(path: Path) -> None:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise Unavailable(f"{path} exists and is not a socket")
    # A crash of ours leaves a socket of our uid; another user's socket is theirs to remove,
    # even when nobody listens on it (the folder may be shared, e.g. /run).
    if found.st_uid != os.geteuid():
        raise Unavailable(f"{path} is a socket of uid {found.st_uid}; not removing it")
    try:
        stream = await anyio.connect_unix(path)
    except ConnectionRefusedError:
        log.info("control_stale_socket_removed", socket=str(path))
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except OSError as e:
        raise Unavailable(f"cannot tell whether {path} is in use: {e}") from None
    await stream.aclose()
    raise Unavailable(f"another workflowd is listening on {path}")


def unlink_if_same(path: Path, created: os.stat_result) -> None:
    """Remove the socket file at `path` if it is still the one we created."""
    with contextlib.suppress(FileNotFoundError):
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (created.st_dev, created.st_ino):
            os.unlink(path)


#: SO_PEERGROUPS (Linux 4.13): the peer's groups as they were at connect(); Python names no
#: constant for it.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def peer_groups(sock: socket.socket, pid: int, uid: int, gid: int) -> set[int]:
    """Return a connected peer's groups: `gid` and its supplementary groups.

    Taken from the peer process, never from the user database, so a client that dropped its
    groups (setgroups, `setpriv --clear-groups`) is not counted in them: first from the socket
    (SO_PEERGROUPS, which also works when the service cannot see other users' processes,
    ProtectProc=invisible), else from the `Groups:` of /proc/PID/status.
    """
    size = 256
    while size <= 65536:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * size)
        except OSError as e:
            if e.errno == errno.ERANGE:  # more groups than the buffer holds
                size *= 16
                continue
            break  # an old kernel: ask /proc
        return {gid, *struct.unpack(f"{len(raw) // 4}I", raw)}
    return _proc_groups(pid, uid, gid)


def _proc_groups(pid: int, uid: int, gid: int) -> set[int]:
    """Return `gid` and the `Groups:` of /proc/PID/status, if that process is still `uid`'s."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            fields = dict(line.partition(":")[::2] for line in f)
    except OSError:
        return {gid}
    try:
        effective_uid = int(fields["Uid"].split()[1])
        groups = {int(g) for g in fields.get("Groups", "").split()}
    except (KeyError, IndexError, ValueError):
        return {gid}
    return {gid, *groups} if effective_uid == uid else {gid}


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """Return the connected peer's (pid, uid, gid) from SO_PEERCRED."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


async def accept(listener: anyio.abc.SocketListener) -> socket.socket:
    """Accept the next client on `listener` as a raw non-blocking socket."""
    raw = listener.extra(anyio.abc.SocketAttribute.raw_socket)
    sock, _ = await asyncio.get_running_loop().sock_accept(raw)
    return sock
