"""Fixtures shared by the whole suite; a test file never imports a fixture from another."""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

# Plain asserts in the helpers get pytest's detailed failure messages too.
pytest.register_assert_rewrite("tests.helpers")

from daemon.service.log import close_logging, set_level
from tests.helpers.memory import MemoryBackend

# A suite started in the background by a non-interactive shell (`pytest &` in a script) has
# SIGINT ignored, and every process it starts would inherit that: tests that stop
# `workflowctl logs -f` or the daemon with SIGINT would hang. A handled signal is reset to
# its default in a child, so handling it here gives children the normal Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short folder under /tmp: a Unix socket path is limited to 107 bytes.

    (pytest's tmp_path can be longer.) Made with mode 0700; a test that lets another uid in
    changes that itself.
    """
    path = Path(tempfile.mkdtemp(prefix="wfd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo configure_logging so other tests see structlog's defaults."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    close_logging()
    set_level("info")
    structlog.reset_defaults()
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    logging.getLogger("aiosqlite").setLevel(logging.NOTSET)


@pytest.fixture
def backend() -> MemoryBackend:
    """An in-memory control backend holding one waiting workflow, `wf-1` (pc 7)."""
    b = MemoryBackend()
    b.workflows["wf-1"] = {
        "workflow_id": "wf-1",
        "workflow": "approval",
        "status": "Waiting",
        "updated_at": "2023-12-31T00:00:00Z",
        "waiting_for": ["approve", "reject", "crash", "odd"],
        "pc": 7,
        "data": {},
    }
    b.histories["wf-1"] = [{"seq": 1, "kind": "started", "detail": None}]
    return b
