"""The dashboard's token file: made once with mode 0600, kept across restarts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from daemon.errors import ConfigError
from daemon.http.token import TOKEN_FILE, form_key, load_token, same


def test_token_is_made_private_and_kept(tmp_path: Path) -> None:
    """The first call makes it (0600 whatever the umask); later calls read the same one."""
    old = os.umask(0)
    try:
        token = load_token(tmp_path)
    finally:
        os.umask(old)
    path = tmp_path / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) >= 32
    path.chmod(0o644)
    assert load_token(tmp_path) == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_empty_token_file_is_refused(tmp_path: Path) -> None:
    """A file without a usable token stops the start, naming it."""
    (tmp_path / TOKEN_FILE).write_text("\n")
    with pytest.raises(ConfigError, match="no usable token"):
        load_token(tmp_path)


def test_comparisons() -> None:
    """`same` needs the exact token; the form key is derived from it, not equal to it."""
    assert same("abc", "abc") and not same("abd", "abc") and not same(None, "abc")
    assert form_key("abc") != "abc" and form_key("abc") == form_key("abc")
