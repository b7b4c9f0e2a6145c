"""A throwaway PostgreSQL cluster for tests: found through $WORKFLOWD_TEST_DSN, or started here.

`.ci/run` starts one (as the `postgres` user, on a Unix socket in a temporary folder) and
exports its DSN; a developer's run without it starts its own the same way when the server
binaries are installed and we are root. Each test gets a fresh database of its own
(`fresh_database`), dropped afterwards.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

#: The environment variable naming a running server's admin DSN (a database we may CREATE in).
DSN_VAR = "WORKFLOWD_TEST_DSN"


@dataclass(frozen=True)
class Cluster:
    """A reachable PostgreSQL server: how to reach it as an admin, and who runs it."""

    host: str  #: the folder holding its Unix socket
    port: int
    user: str
    stop_cmd: tuple[str, ...] = ()

    def dsn(self, database: str = "postgres") -> str:
        """Return a DSN for `database` on this server."""
        return f"postgresql://{self.user}@/{database}?host={self.host}&port={self.port}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run one SQL command as the admin and return its output."""
        exe = _binary("psql") or "psql"
        proc = subprocess.run(
            [exe, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", self.dsn(database), "-c", sql],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"psql failed: {proc.stderr.strip()}")
        return proc.stdout.strip()

    def stop(self) -> None:
        """Stop the server if this process started it."""
        if self.stop_cmd:
            subprocess.run(self.stop_cmd, capture_output=True, check=False)
            shutil.rmtree(self.host, ignore_errors=True)


def _binary(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _from_env(dsn: str) -> Cluster:
    """Parse the `postgresql://user@/db?host=DIR&port=N` form .ci/run exports."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "/var/run/postgresql"])[0]
    port = int(query.get("port", [str(parts.port or 5432)])[0])
    return Cluster(host=host, port=port, user=parts.username or "postgres")


def find_or_start() -> tuple[Cluster | None, str]:
    """Return a cluster to test against, or None and the reason there is none."""
    env = os.environ.get(DSN_VAR)
    if env:
        cluster = _from_env(env)
        try:
            cluster.psql("SELECT 1")
        except (OSError, RuntimeError) as e:
            return None, f"${DSN_VAR} is set but its server does not answer: {e}"
        return cluster, ""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        return None, "no PostgreSQL server binaries (apt-get install postgresql)"
    if os.geteuid() != 0:
        return None, f"not root: cannot start a cluster as `postgres`; set ${DSN_VAR}"
    root = Path(tempfile.mkdtemp(prefix="wfd-pg-", dir="/tmp"))
    os.chmod(root, 0o755)
    shutil.chown(root, "postgres")
    data, as_pg = root / "data", ["runuser", "-u", "postgres", "--"]
    port = 5432
    init = subprocess.run(
        [*as_pg, initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
        capture_output=True,
        text=True,
        check=False,
    )
    if init.returncode != 0:
        return None, f"initdb failed: {init.stderr.strip()[-300:]}"
    opts = f"-k {root} -c listen_addresses='' -p {port} -c fsync=off -c max_connections=200"
    start = subprocess.run(
        [*as_pg, pg_ctl, "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start"],
        capture_output=True,
        text=True,
        check=False,
    )
    if start.returncode != 0:
        return None, f"pg_ctl start failed: {start.stderr.strip()[-300:]}"
    stop = (*as_pg, pg_ctl, "-D", str(data), "-m", "immediate", "stop")
    return Cluster(host=str(root), port=port, user="postgres", stop_cmd=stop), ""


def fresh_database(cluster: Cluster) -> str:
    """Create an empty database and return its DSN."""
    name = f"wfd_{uuid.uuid4().hex[:12]}"
    cluster.psql(f"CREATE DATABASE {name}")
    return cluster.dsn(name)


def drop_database(cluster: Cluster, dsn: str) -> None:
    """Drop a database `fresh_database` made, disconnecting whoever is still on it."""
    name = dsn.split("@/", 1)[1].split("?", 1)[0]
    cluster.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@dataclass
class E2EStore:
    """What `--store` chose for e2e daemons, and the databases made for the running test."""

    backend: str = "sqlite"
    cluster: Cluster | None = None
    #: One database per [store] path a test's configs name, so a restart finds its data.
    made: dict[str, str] = field(default_factory=dict)

    def dsn_for(self, path: str) -> str:
        """Return the database standing for the SQLite file `path`, made on first use."""
        assert self.cluster is not None, "the _postgres_for_e2e fixture sets the cluster"
        if path not in self.made:
            self.made[path] = fresh_database(self.cluster)
        return self.made[path]


#: Set by tests/conftest.py from `--store`; read by tests/helpers/harness.write_config.
E2E = E2EStore()
