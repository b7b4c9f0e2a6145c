"""Tests for daemon.config: loading, defaults, validation and module import."""

from __future__ import annotations

import grp
import os
import sys
from pathlib import Path

import pytest

from daemon.errors import ConfigError
from daemon.ops.modules import import_workflow_modules
from daemon.service.config import Config, load_config, parse_config
from tests.helpers import REPO


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    return message


class TestDefaults:
    def test_repo_config_loads(self) -> None:
        """The checkout's config.toml loads and resolves paths against the checkout."""
        cfg = load_config(REPO / "config.toml")
        assert cfg.source == REPO / "config.toml"
        assert cfg.daemon.socket == REPO / "state" / "workflowd.sock"
        assert cfg.daemon.socket_mode == 0o660
        assert cfg.store.path == REPO / "state" / "workflowd.db"
        assert cfg.store.synchronous == "normal"
        assert cfg.workflows.paths == (REPO,)
        assert cfg.workflows.modules == ("daemon.examples",)
        assert cfg.runtime.retry_max_attempts == 0
        assert (cfg.log.level, cfg.log.format) == ("info", "auto")

    def test_repo_config_equals_empty_config(self, tmp_path: Path) -> None:
        """Every value in the shipped config.toml is the built-in default."""
        shipped = load_config(REPO / "config.toml")
        empty = parse_config({}, REPO / "config.toml")
        assert shipped == empty

    def test_missing_keys_take_defaults(self, tmp_path: Path) -> None:
        """A file setting one key keeps the defaults for the rest, relative to its own folder."""
        cfg = load_config(write(tmp_path, "[runtime]\nmax_concurrent_steps = 3\n"))
        assert cfg.runtime.max_concurrent_steps == 3
        assert cfg.runtime.retry_initial_s == 1.0
        assert cfg.store.path == tmp_path / "state" / "workflowd.db"
        assert cfg.store.backups == tmp_path / "state" / "backups"  # beside the database
        assert (cfg.store.backup_keep, cfg.store.min_free_bytes) == (7, 64 << 20)

    def test_values_are_converted(self, tmp_path: Path) -> None:
        """Ints are accepted for floats, lists become tuples and group names become gids."""
        group = grp.getgrgid(os.getgid()).gr_name
        cfg = load_config(
            write(
                tmp_path,
                f'[daemon]\nidle_timeout_s = 5\nallowed_uids = [0, 1000]\nsocket_mode = "600"\n'
                f'allowed_groups = ["{group}", 4]\n[workflows]\npaths = ["wf", "/abs"]\n',
            )
        )
        assert cfg.daemon.idle_timeout_s == 5.0
        assert isinstance(cfg.daemon.idle_timeout_s, float)
        assert cfg.daemon.allowed_uids == (0, 1000)
        assert cfg.daemon.allowed_groups == (os.getgid(), 4)
        assert cfg.daemon.socket_mode == 0o600
        assert cfg.workflows.paths == (tmp_path / "wf", Path("/abs"))

    def test_default_path_honours_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """$WORKFLOWD_CONFIG wins; otherwise the checkout's file is used."""
        monkeypatch.setenv("WORKFLOWD_CONFIG", "/x/y.toml")
        assert Config.default_path() == Path("/x/y.toml")
        monkeypatch.delenv("WORKFLOWD_CONFIG")
        assert Config.default_path() == REPO / "config.toml"

    def test_config_is_frozen(self) -> None:
        """Config objects cannot be changed after loading."""
        cfg = load_config(REPO / "config.toml")
        with pytest.raises(AttributeError):
            cfg.log.level = "debug"  # type: ignore[misc]


class TestErrors:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            (
                '[runtime]\nretry_initial_s = "x"',
                "[runtime] retry_initial_s: expected a number, got 'x'",
            ),
            (
                "[runtime]\nretry_initial_s = true",
                "[runtime] retry_initial_s: expected a number, got True",
            ),
            ("[runtime]\nretry_initial_s = nan", "[runtime] retry_initial_s: expected a number"),
            ("[runtime]\nretry_initial_s = 0", "[runtime] retry_initial_s: must be > 0"),
            (
                "[runtime]\nmax_concurrent_steps = true",
                "[runtime] max_concurrent_steps: expected an integer, got True",
            ),
            (
                "[runtime]\nmax_concurrent_steps = 2.5",
                "[runtime] max_concurrent_steps: expected an integer, got 2.5",
            ),
            (
                "[runtime]\nmax_concurrent_steps = 0",
                "[runtime] max_concurrent_steps: must be >= 1, got 0",
            ),
            ("[runtime]\nretry_max_attempts = -1", "[runtime] retry_max_attempts: must be >= 0"),
            ("[store]\nhistory_keep = 0", "[store] history_keep: must be >= 1, got 0"),
            (
                "[store]\nretention_interval_s = 0",
                "[store] retention_interval_s: must be > 0, got 0.0",
            ),
            (
                "[runtime]\nretry_initial_s = 10.0\nretry_max_s = 5.0",
                "[runtime] retry_max_s: must be >= retry_initial_s",
            ),
            ("[runtime]\nretries = 3", "[runtime] retries: unknown key"),
            ("[nope]\nx = 1", "unknown section [nope]"),
            ("daemon = 3", "[daemon] must be a table"),
            (
                '[store]\nsynchronous = "off"',
                "[store] synchronous: expected one of normal, full; got 'off'",
            ),
            ('[log]\nlevel = "verbose"', "[log] level: expected one of debug, info"),
            (
                '[log]\nformat = "xml"',
                "[log] format: expected one of auto, json, console; got 'xml'",
            ),
            (
                "[daemon]\nsocket_mode = 432",
                '[daemon] socket_mode: expected an octal string like "0660", got 432',
            ),
            ('[daemon]\nsocket_mode = "0999"', "[daemon] socket_mode: expected an octal string"),
            ("[daemon]\nallowed_uids = 5", "[daemon] allowed_uids: expected a list, got 5"),
            ("[daemon]\nallowed_uids = [-1]", "[daemon] allowed_uids: must be >= 0, got -1"),
            (
                '[daemon]\nallowed_uids = ["root"]',
                "[daemon] allowed_uids: expected an integer, got 'root'",
            ),
            (
                '[daemon]\nallowed_groups = ["no-such-group-xyz"]',
                "[daemon] allowed_groups: unknown group 'no-such-group-xyz'",
            ),
            ("[daemon]\nsocket = 3", "[daemon] socket: expected a path string, got 3"),
            ('[daemon]\nsocket = ""', "[daemon] socket: expected a path string"),
            (
                f'[daemon]\nsocket = "/{"s" * 120}"',
                "[daemon] socket: path too long for a Unix socket",
            ),
            ("[store]\npath = []", "[store] path: expected a path string, got []"),
            (
                '[store]\npath = "$HOME/db"',
                "[store] path: only $STATE_DIRECTORY and $RUNTIME_DIRECTORY",
            ),
            (
                '[workflows]\nmodules = ["a b"]',
                "[workflows] modules: expected dotted module names, got 'a b'",
            ),
            ('[workflows]\nmodules = "a"', "[workflows] modules: expected a list, got 'a'"),
            ("[workflows]\npaths = [1]", "[workflows] paths: expected a path string, got 1"),
            (
                '[store]\npath = "db/wd.db"\nbackup_dir = "db"',
                "[store] backup_dir: must not be the database's own folder",
            ),
            ("[store]\nbackup_keep = 0", "[store] backup_keep: must be >= 1, got 0"),
            ("[store]\nmin_free_bytes = -1", "[store] min_free_bytes: must be >= 0, got -1"),
            (
                '[daemon]\nsocket_group = "no-such-group-xyz"',
                "[daemon] socket_group: unknown group 'no-such-group-xyz'",
            ),
        ],
    )
    def test_bad_value_names_the_key(self, tmp_path: Path, text: str, expected: str) -> None:
        """Each kind of bad value gives one line naming the file and the key."""
        message = error_of(tmp_path, text)
        assert message.startswith(f"{tmp_path / 'config.toml'}: ")
        assert expected in message

    def test_invalid_toml(self, tmp_path: Path) -> None:
        """A syntax error is reported on one line with the file name."""
        assert "invalid TOML" in error_of(tmp_path, "[daemon\n")

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing file is a ConfigError, not an OSError."""
        with pytest.raises(ConfigError, match="cannot read: No such file"):
            load_config(tmp_path / "absent.toml")


class TestPostgresStore:
    def test_sqlite_is_the_default(self, tmp_path: Path) -> None:
        """No [store] backend means SQLite, with a lease of 15 s for when it is PostgreSQL."""
        cfg = load_config(write(tmp_path, ""))
        assert (cfg.store.backend, cfg.store.dsn, cfg.store.lease_s) == ("sqlite", "", 15.0)

    def test_dsn_from_the_file(self, tmp_path: Path) -> None:
        """A password-less dsn, node_id, lease_s and a passfile are read as given."""
        cfg = load_config(write(tmp_path, '[store]\nbackend = "postgres"\n'
                                'dsn = "postgresql://wf@db/wf"\nnode_id = "n1"\nlease_s = 5\n'
                                'passfile = "pgpass"\n'))  # fmt: skip
        s = cfg.store
        assert (s.dsn, s.node_id, s.lease_s, s.passfile) == (
            "postgresql://wf@db/wf", "n1", 5.0, tmp_path / "pgpass",
        )  # fmt: skip

    def test_dsn_from_the_environment_may_hold_a_password(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An empty dsn is read from $WORKFLOWD_DSN, which may carry the password."""
        monkeypatch.setenv("WORKFLOWD_DSN", "postgresql://wf:pw@db/wf")
        cfg = load_config(write(tmp_path, '[store]\nbackend = "postgres"\n'))
        assert cfg.store.dsn == "postgresql://wf:pw@db/wf"

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ('dsn = "postgresql://wf:pw@db/wf"', "[store] dsn: must not hold a password"),
            ('dsn = "postgresql://wf@db/wf?password=pw"', "[store] dsn: must not hold a password"),
            ('dsn = "mysql://wf@db/wf"', "[store] dsn: expected a postgresql:// URL"),
            ("dsn = 5", "[store] dsn: expected a string"),
            ("", "[store] dsn: backend postgres needs a dsn (or $WORKFLOWD_DSN)"),
            ('dsn = "postgresql://db/wf"\nlease_s = 0', "[store] lease_s: must be > 0"),
        ],
    )
    def test_bad_postgres_settings(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, expected: str
    ) -> None:
        """Each bad setting is one line naming the key; a password is never echoed."""
        monkeypatch.delenv("WORKFLOWD_DSN", raising=False)
        message = error_of(tmp_path, f'[store]\nbackend = "postgres"\n{text}\n')
        assert expected in message and "pw" not in message


class TestSystemdDirectories:
    def test_state_and_runtime_directory_expand(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """$STATE_DIRECTORY and $RUNTIME_DIRECTORY at the start of a path are expanded."""
        monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/workflowd:/var/lib/other")
        monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/workflowd")
        cfg = load_config(
            write(
                tmp_path,
                '[store]\npath = "$STATE_DIRECTORY/workflowd.db"\n'
                '[daemon]\nsocket = "$RUNTIME_DIRECTORY/workflowd.sock"\n',
            )
        )
        assert cfg.store.path == Path("/var/lib/workflowd/workflowd.db")
        assert cfg.daemon.socket == Path("/run/workflowd/workflowd.sock")

    def test_unset_variable_is_an_error(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An unset variable is a clear error naming the key and the systemd setting."""
        monkeypatch.delenv("STATE_DIRECTORY", raising=False)
        message = error_of(tmp_path, '[store]\npath = "$STATE_DIRECTORY/workflowd.db"')
        assert "[store] path: $STATE_DIRECTORY is not set" in message
        assert "StateDirectory=" in message

    def test_example_service_config_loads(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """systemd/config.toml is valid once systemd has set the directories and the group exists."""
        real = grp.getgrnam
        fake = grp.struct_group(("workflowd", "x", 4242, []))
        monkeypatch.setattr(grp, "getgrnam", lambda n: fake if n == "workflowd" else real(n))
        monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/workflowd")
        monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/workflowd")
        cfg = load_config(REPO / "systemd" / "config.toml")
        assert cfg.store.path == Path("/var/lib/workflowd/workflowd.db")
        assert cfg.daemon.socket == Path("/run/workflowd/workflowd.sock")
        assert cfg.daemon.allowed_groups == (4242,)
        assert cfg.daemon.socket_group == 4242
        assert cfg.workflows.paths == (REPO / "systemd" / "workflows",)
        assert "daemon.examples" not in cfg.workflows.modules  # they act on clients' paths
        assert cfg.store.backups == Path("/var/lib/workflowd/backups")
        assert cfg.store.retention_interval_s == 3600.0


class TestImportWorkflowModules:
    def test_imports_from_configured_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Modules are imported from the configured paths, which land on sys.path."""
        monkeypatch.setattr(sys, "path", list(sys.path))
        (tmp_path / "wf").mkdir()
        (tmp_path / "wf" / "cfgtest_good.py").write_text("VALUE = 42\n")
        cfg = load_config(
            write(tmp_path, '[workflows]\npaths = ["wf"]\nmodules = ["cfgtest_good"]\n')
        )
        try:
            [module] = import_workflow_modules(cfg)
            assert module.VALUE == 42
            assert str(tmp_path / "wf") in sys.path
        finally:
            sys.modules.pop("cfgtest_good", None)

    @pytest.mark.parametrize(
        ("source", "reason"),
        [
            (None, "ModuleNotFoundError: No module named 'cfgtest_bad'"),
            ("def f(:\n", "SyntaxError: "),
            ("raise RuntimeError('boom\\nsecond line')\n", "RuntimeError: boom second line"),
        ],
    )
    def test_import_failure_is_config_error(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str | None, reason: str
    ) -> None:
        """A module that is missing, broken or raises gives one line naming it and the reason."""
        monkeypatch.setattr(sys, "path", list(sys.path))
        if source is not None:
            (tmp_path / "cfgtest_bad.py").write_text(source)
        cfg = load_config(write(tmp_path, '[workflows]\nmodules = ["cfgtest_bad"]\n'))
        try:
            with pytest.raises(ConfigError) as info:
                import_workflow_modules(cfg)
        finally:
            sys.modules.pop("cfgtest_bad", None)
        message = str(info.value)
        assert message.startswith("[workflows] modules: cannot import 'cfgtest_bad': ")
        assert reason in message
        assert "\n" not in message


class TestObserveSections:
    """[metrics], [hooks] and [http]."""

    def test_defaults_are_off(self, tmp_path: Path) -> None:
        """Nothing listens and no hook runs unless configured."""
        cfg = load_config(write(tmp_path, ""))
        assert cfg.metrics.listen == "" and cfg.http.listen == ""
        assert cfg.hooks.on_failure == () and cfg.hooks.timeout_s == 30.0

    def test_values(self, tmp_path: Path) -> None:
        """host:port stays as given; a socket path resolves against the config's folder."""
        cfg = load_config(
            write(
                tmp_path,
                '[metrics]\nlisten = "127.0.0.1:9464"\n[http]\nlisten = "state/dash.sock"\n'
                '[hooks]\non_failure = ["/bin/notify", "{workflow_id}"]\ntimeout_s = 5\n',
            )
        )
        assert cfg.metrics.listen == "127.0.0.1:9464"
        assert cfg.http.listen == str(tmp_path / "state" / "dash.sock")
        assert cfg.hooks.on_failure == ("/bin/notify", "{workflow_id}")
        assert cfg.hooks.timeout_s == 5.0

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ('[metrics]\nlisten = "9464"', "[metrics] listen"),
            ('[http]\nlisten = "localhost:0"', "[http] listen"),
            ("[http]\nlisten = 8473", "[http] listen"),
            ('[hooks]\non_failure = "/bin/notify"', "[hooks] on_failure: expected a list"),
            ('[hooks]\non_finish = ["", "x"]', "[hooks] on_finish: the program"),
            ('[hooks]\non_failure = ["/bin/x", "{who}"]', "unknown placeholder {who}"),
            ("[hooks]\ntimeout_s = 0", "[hooks] timeout_s"),
        ],
    )
    def test_errors(self, tmp_path: Path, text: str, message: str) -> None:
        """Each bad value stops the start with one line naming the key."""
        assert message in error_of(tmp_path, text)
