"""The dashboard's access token: random, kept in the state folder with mode 0600 (like Jupyter's)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from daemon.errors import ConfigError

TOKEN_FILE = "dashboard.token"
FILE_MODE = 0o600


def load_token(folder: Path) -> str:
    """Return the token kept in `folder`, making one (0600, whatever the umask) if there is none.

    It stays the same across restarts, so a bookmarked URL keeps working; delete the file and
    restart to revoke it.
    """
    path = folder / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        return _read(path)
    except OSError as e:
        raise ConfigError(f"cannot create {path}: {e.strerror or e}") from None
    token = secrets.token_urlsafe(32)
    try:
        os.fchmod(fd, FILE_MODE)
        os.write(fd, f"{token}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return token


def _read(path: Path) -> str:
    try:
        os.chmod(path, FILE_MODE)  # a looser file (copied in by hand) is tightened
        token = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if len(token) < 16:
        raise ConfigError(f"{path} holds no usable token; delete it to make a new one")
    return token


def same(given: str | None, token: str) -> bool:
    """Compare a presented token with ours in constant time."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def form_key(token: str) -> str:
    """Return the value the dashboard's forms carry, so another site cannot post them."""
    return hmac.new(token.encode(), b"dashboard-form", hashlib.sha256).hexdigest()[:32]
