"""Load and validate config.toml into frozen dataclasses."""

from __future__ import annotations

import dataclasses
import grp
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from daemon.errors import ConfigError
from daemon.observe.hooks import check_template

# Only these two are expanded, so "$HOME" or "$FOO" in a path is an error, not a folder named "$FOO".
_DIR_VARS = {"STATE_DIRECTORY": "StateDirectory=", "RUNTIME_DIRECTORY": "RuntimeDirectory="}
_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the NUL


def _opt(kind: str, default: Any, **rules: Any) -> Any:
    """Declare a config key: its kind drives validation, rules bound its value."""
    return field(default=default, metadata={"kind": kind, **rules})


@dataclass(frozen=True)
class DaemonConfig:
    """[daemon]: the control socket and its limits."""

    socket: Path = field(default=Path("state/workflowd.sock"), metadata={"kind": "socket"})
    socket_mode: int = _opt("mode", 0o660)
    allowed_uids: tuple[int, ...] = _opt("uids", ())
    allowed_groups: tuple[int, ...] = _opt("groups", ())  # resolved to gids at load time
    max_request_bytes: int = _opt("int", 1_048_576, min=64)
    max_connections: int = _opt("int", 256, min=1)
    idle_timeout_s: float = _opt("float", 300.0, gt=0)
    shutdown_grace_s: float = _opt("float", 10.0, min=0)
    #: The group (name or gid, resolved at load) a socket the daemon binds itself is given.
    socket_group: int | None = _opt("socket_group", None)
    #: Requests one connection may have in flight; it is read no further until one is answered.
    max_in_flight: int = _opt("int", 16, min=1)
    #: Unread output past which a connection is dropped (and logged).
    max_buffered_bytes: int = _opt("int", 4 << 20, min=65_536)


@dataclass(frozen=True)
class StoreConfig:
    """[store]: the SQLite database."""

    path: Path = field(default=Path("state/workflowd.db"), metadata={"kind": "path"})
    synchronous: str = _opt("enum", "normal", choices=("normal", "full"))
    history_keep: int = _opt("int", 1000, min=1)
    keep_finished_days: int = _opt("int", 30, min=0)
    #: How often retention runs (it also runs at start).
    retention_interval_s: float = _opt("float", 3600.0, gt=0)
    #: The only folder `backup` writes to; None: `backups/` beside the database (see `backups`).
    backup_dir: Path | None = field(default=None, metadata={"kind": "path"})
    #: Backups kept in `backup_dir`; a new one beyond this deletes the oldest.
    backup_keep: int = _opt("int", 7, min=1)
    #: A backup that would leave less free space than this on its disk is refused.
    min_free_bytes: int = _opt("int", 64 << 20, min=0)
    #: "sqlite" (the file at `path`) or "postgres" (the server at `dsn`).
    backend: str = _opt("enum", "sqlite", choices=("sqlite", "postgres"))
    #: postgresql://user@host/db; empty: $WORKFLOWD_DSN. A password only from the environment.
    dsn: str = _opt("str", "")
    #: A libpq passfile (~/.pgpass format) for the dsn's password.
    passfile: Path | None = field(default=None, metadata={"kind": "optpath"})
    #: This daemon's name among those sharing a PostgreSQL database (default: the hostname).
    node_id: str = _opt("str", "")
    #: How long a PostgreSQL lease lasts unrenewed: a dead daemon's workflows go to the others.
    lease_s: float = _opt("float", 15.0, gt=0)
    #: How long the node a FileWatch or SocketListen wait is pinned to may be gone before another
    #: node claims the workflow and sets the wait up again (`wait_moved`).
    pin_timeout_s: float = _opt("float", 300.0, gt=0)

    @property
    def backups(self) -> Path:
        """Return the folder backups go to: `backup_dir`, else `backups/` beside the database."""
        return self.backup_dir or self.path.parent / "backups"


@dataclass(frozen=True)
class WorkflowsConfig:
    """[workflows]: where workflow classes are imported from."""

    paths: tuple[Path, ...] = _opt("paths", (Path("."),))
    modules: tuple[str, ...] = _opt("modules", ("daemon.examples",))


@dataclass(frozen=True)
class RuntimeConfig:
    """[runtime]: concurrency and step retries."""

    max_concurrent_steps: int = _opt("int", 64, min=1)
    retry_initial_s: float = _opt("float", 1.0, gt=0)
    retry_max_s: float = _opt("float", 300.0, gt=0)
    retry_max_attempts: int = _opt("int", 0, min=0)  # 0: retry forever


@dataclass(frozen=True)
class LogConfig:
    """[log]: level and output format."""

    level: str = _opt("enum", "info", choices=("debug", "info", "warning", "error", "critical"))
    format: str = _opt("enum", "auto", choices=("auto", "json", "console"))


@dataclass(frozen=True)
class MetricsConfig:
    """[metrics]: where Prometheus scrapes `/metrics` ("host:port" or a Unix socket path)."""

    listen: str = _opt("listen", "")  # "": off


@dataclass(frozen=True)
class HooksConfig:
    """[hooks]: programs run when a workflow fails or finishes (argv templates, no shell)."""

    on_failure: tuple[str, ...] = _opt("argv", ())
    on_finish: tuple[str, ...] = _opt("argv", ())
    timeout_s: float = _opt("float", 30.0, gt=0)


@dataclass(frozen=True)
class HttpConfig:
    """[http]: where the dashboard is served ("host:port" or a Unix socket path)."""

    listen: str = _opt("listen", "")  # "": off


_SECTIONS: dict[str, type[Any]] = {
    "daemon": DaemonConfig,
    "store": StoreConfig,
    "workflows": WorkflowsConfig,
    "runtime": RuntimeConfig,
    "log": LogConfig,
    "metrics": MetricsConfig,
    "hooks": HooksConfig,
    "http": HttpConfig,
}


@dataclass(frozen=True)
class Config:
    """The whole configuration; paths are absolute."""

    source: Path
    daemon: DaemonConfig
    store: StoreConfig
    workflows: WorkflowsConfig
    runtime: RuntimeConfig
    log: LogConfig
    metrics: MetricsConfig = MetricsConfig()
    hooks: HooksConfig = HooksConfig()
    http: HttpConfig = HttpConfig()

    @staticmethod
    def default_path() -> Path:
        """Return $WORKFLOWD_CONFIG, else the checkout's config.toml, else /etc/workflowd's."""
        if env := os.environ.get("WORKFLOWD_CONFIG"):
            return Path(env)
        checkout = Path(__file__).resolve().parents[2] / "config.toml"
        return checkout if checkout.is_file() else Path("/etc/workflowd/config.toml")


def load_config(path: Path) -> Config:
    """Read, validate and return the config file at `path`; raise ConfigError on any problem."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    return parse_config(raw, path)


def parse_config(raw: Mapping[str, Any], path: Path) -> Config:
    """Validate an already-parsed TOML table as if it were read from `path`."""
    base = Path(os.path.abspath(path)).parent
    for name, table in raw.items():
        if name not in _SECTIONS:
            raise ConfigError(f"{path}: unknown section [{name}]")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{name}] must be a table")
    parts = {
        name: _section(cls, name, raw.get(name, {}), path, base) for name, cls in _SECTIONS.items()
    }
    store: StoreConfig = parts["store"]
    if store.backups == store.path.parent:
        # Old backups there are deleted beyond backup_keep; the database must not be among them.
        raise ConfigError(f"{path}: [store] backup_dir: must not be the database's own folder")
    parts["store"] = _store_dsn(store, path)
    runtime: RuntimeConfig = parts["runtime"]
    if runtime.retry_max_s < runtime.retry_initial_s:
        raise ConfigError(f"{path}: [runtime] retry_max_s: must be >= retry_initial_s")
    return Config(source=Path(os.path.abspath(path)), **parts)


def _store_dsn(store: StoreConfig, path: Path) -> StoreConfig:
    """Check `[store] dsn` for the postgres backend; an empty one is read from $WORKFLOWD_DSN.

    A password in the config file is refused (files are often readable by more users than
    the environment); one in $WORKFLOWD_DSN is accepted.
    """
    if store.backend != "postgres":
        return store
    from_file = bool(store.dsn)
    dsn = store.dsn or os.environ.get("WORKFLOWD_DSN", "")
    if not dsn:
        raise ConfigError(f"{path}: [store] dsn: backend postgres needs a dsn (or $WORKFLOWD_DSN)")
    parts = urlsplit(dsn)
    where = "[store] dsn" if from_file else "$WORKFLOWD_DSN"
    if parts.scheme not in ("postgresql", "postgres"):
        raise ConfigError(f"{path}: {where}: expected a postgresql:// URL")
    query = dict(parse_qsl(parts.query))
    if from_file and (parts.password is not None or "password" in query):
        raise ConfigError(
            f"{path}: [store] dsn: must not hold a password; use $PGPASSWORD, $WORKFLOWD_DSN"
            " or [store] passfile"
        )
    return dataclasses.replace(store, dsn=dsn)


def _section(cls: type[Any], name: str, table: dict[str, Any], path: Path, base: Path) -> Any:
    """Build one section's dataclass, converting and checking every key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = f"{path}: [{name}] {key}"
        if key not in fields:
            raise ConfigError(f"{where}: unknown key")
        try:
            values[key] = _convert(value, dict(fields[key].metadata), base)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
    for key, f in fields.items():
        # Default relative paths resolve against the config file's folder, like given ones.
        if (
            key not in values
            and f.default is not None
            and f.metadata["kind"] in ("path", "socket", "paths")
        ):
            values[key] = _convert(_unparse(f.default), dict(f.metadata), base)
    return cls(**values)


def _unparse(value: Any) -> Any:
    """Turn a default back into its TOML form."""
    return [str(v) for v in value] if isinstance(value, tuple) else str(value)


def _convert(value: Any, meta: dict[str, Any], base: Path) -> Any:
    """Convert one TOML value per its declared kind; raise TypeError/ValueError with the reason."""
    kind = meta["kind"]
    if kind == "int":
        return _bounded(_int(value), meta)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise TypeError(f"expected a number, got {value!r}")
        if math.isinf(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        return _bounded(float(value), meta)
    if kind == "enum":
        if value not in meta["choices"]:
            raise ValueError(f"expected one of {', '.join(meta['choices'])}; got {value!r}")
        return value
    if kind == "mode":
        if not isinstance(value, str) or not re.fullmatch(r"0?[0-7]{3}", value):
            raise ValueError(f'expected an octal string like "0660", got {value!r}')
        return int(value, 8)
    if kind == "socket_group":
        return _own_gid(value)
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return value
    if kind == "optpath":
        return _path(value, base)
    if kind in ("path", "socket"):
        p = _path(value, base)
        if kind == "socket" and len(os.fsencode(p)) > _SUN_PATH_MAX:
            raise ValueError(f"path too long for a Unix socket (over {_SUN_PATH_MAX} bytes): {p}")
        return p
    if kind == "listen":
        return _listen(value, base)
    items = _list(value)
    if kind == "argv":
        return _argv(items)
    if kind == "paths":
        return tuple(_path(v, base) for v in items)
    if kind == "modules":
        bad = [m for m in items if not isinstance(m, str) or not _MODULE_RE.match(m)]
        if bad:
            raise ValueError(f"expected dotted module names, got {bad[0]!r}")
        return tuple(items)
    if kind == "uids":
        return tuple(_bounded(_int(v), {"min": 0}) for v in items)
    return tuple(_gid(v) for v in items)  # kind == "groups"


def _argv(items: list[Any]) -> tuple[str, ...]:
    """Check a hook's argv template: strings, a program first, known placeholders only."""
    if any(not isinstance(a, str) for a in items):
        raise TypeError(f"expected a list of strings, got {items!r}")
    if items and not items[0]:
        raise ValueError("the program (first item) is empty")
    check_template(items)
    return tuple(items)


def _listen(value: Any, base: Path) -> str:
    """Check an address to serve HTTP on: "", "host:port", or a Unix socket path."""
    if not isinstance(value, str):
        raise TypeError(f'expected "host:port" or a socket path, got {value!r}')
    if not value:
        return ""
    if "/" in value:
        p = _path(value, base)
        if len(os.fsencode(p)) > _SUN_PATH_MAX:
            raise ValueError(f"path too long for a Unix socket (over {_SUN_PATH_MAX} bytes): {p}")
        return str(p)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f'expected "host:port" (port 1-65535) or a socket path, got {value!r}')
    return value


def _int(value: Any) -> int:
    """Accept an int but not a bool (TOML true is not 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _bounded(value: Any, meta: dict[str, Any]) -> Any:
    """Check the optional `min` (inclusive) and `gt` (exclusive) bounds."""
    if "min" in meta and value < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}, got {value!r}")
    if "gt" in meta and value <= meta["gt"]:
        raise ValueError(f"must be > {meta['gt']}, got {value!r}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r}")
    return value


def _gid(value: Any) -> int:
    """Resolve a group name or number to a gid now, so a typo fails at start-up."""
    if isinstance(value, str):
        try:
            return grp.getgrnam(value).gr_gid
        except KeyError:
            raise ValueError(f"unknown group {value!r}") from None
    return _bounded(_int(value), {"min": 0})  # type: ignore[no-any-return]


def _own_gid(value: Any) -> int:
    """Resolve a group the daemon must be able to give its socket to (root: any; else its own)."""
    gid = _gid(value)
    if os.geteuid() != 0 and gid not in {os.getegid(), *os.getgroups()}:
        raise ValueError(
            f"the daemon (uid {os.geteuid()}) is not in group {value!r}, so cannot chown to it"
        )
    return gid


def _path(value: Any, base: Path) -> Path:
    """Expand a leading $STATE_DIRECTORY/$RUNTIME_DIRECTORY, else resolve against `base`."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a path string, got {value!r}")
    if value.startswith("$"):
        var, _, rest = value[1:].partition("/")
        if var not in _DIR_VARS:
            raise ValueError(
                f"only $STATE_DIRECTORY and $RUNTIME_DIRECTORY are expanded: {value!r}"
            )
        root = os.environ.get(var, "")
        if not root:
            raise ValueError(f"${var} is not set (it is set by systemd's {_DIR_VARS[var]})")
        # systemd joins several directories with ":"; the first is the one named first.
        return Path(root.split(":")[0]) / rest
    return Path(os.path.normpath(base / value))
