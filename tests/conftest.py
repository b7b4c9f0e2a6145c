"""Fixtures shared by the whole suite; a test file never imports a fixture from another."""

from __future__ import annotations

import logging
import os
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
from tests.helpers import postgres
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


# -- PostgreSQL ----------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add `--store`: the backend e2e daemons (write_config) run on."""
    parser.addoption(
        "--store",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="the store e2e daemons use (postgres: a throwaway cluster, see tests/helpers/postgres)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Tell the harness which backend `--store` chose."""
    postgres.E2E.backend = config.getoption("--store")


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[postgres.Cluster]:
    """A PostgreSQL server for the session: $WORKFLOWD_TEST_DSN's, or one started here.

    Where none can be had the test skips with the reason, except under CI=true, where a
    PostgreSQL test that did not run is a failure (.ci/run starts a cluster).
    """
    cluster, reason = postgres.find_or_start()
    if cluster is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: no PostgreSQL server for the PostgreSQL tests: {reason}")
        pytest.skip(f"no PostgreSQL server: {reason}")
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_dsn(pg_cluster: postgres.Cluster) -> Iterator[str]:
    """A fresh, empty database on the session's PostgreSQL server; dropped afterwards."""
    dsn = postgres.fresh_database(pg_cluster)
    yield dsn
    postgres.drop_database(pg_cluster, dsn)


@pytest.fixture(autouse=True)
def _postgres_for_e2e(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under `--store postgres`, have each e2e test's daemons use databases of this cluster."""
    e2e = postgres.E2E
    if e2e.backend != "postgres" or "e2e" not in request.node.nodeid.split("/"):
        yield
        return
    marker = request.node.get_closest_marker("sqlite_only")
    if marker is not None:
        pytest.skip(f"SQLite only: {marker.args[0] if marker.args else 'uses the file'}")
    e2e.cluster = request.getfixturevalue("pg_cluster")
    try:
        yield
    finally:
        for dsn in e2e.made.values():
            postgres.drop_database(e2e.cluster, dsn)
        e2e.made.clear()
        e2e.cluster = None
