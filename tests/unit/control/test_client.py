"""The Python client's socket discovery and error classes (in process)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from daemon.client import BadInput, ClientError, Conflict, NoSocket, NotFound
from daemon.control.client import ERRORS, error_of, find_socket
from daemon.control.protocol import ERROR_CODES


class TestFindSocket:
    def test_order(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """--socket, $WORKFLOWD_SOCKET, --config, $WORKFLOWD_CONFIG, ./config.toml, /run."""
        for name in ("a", "b", "c"):
            (tmp_path / f"{name}.toml").write_text(f'[daemon]\nsocket = "{name}.sock"\n')
        (tmp_path / "config.toml").write_text('[daemon]\nsocket = "here.sock"\n')
        service = tmp_path / "service.sock"
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv("WORKFLOWD_SOCKET", raising=False)
        monkeypatch.setenv("WORKFLOWD_CONFIG", str(tmp_path / "b.toml"))
        found = find_socket("/s", tmp_path / "a.toml", service_socket=service)
        assert found == Path("/s")
        assert find_socket(None, "a.toml", service_socket=service) == Path("a.sock")
        assert find_socket(service_socket=service) == tmp_path / "b.sock"
        monkeypatch.setenv("WORKFLOWD_SOCKET", "/env.sock")
        assert find_socket(None, "a.toml", service_socket=service) == Path("/env.sock")
        monkeypatch.delenv("WORKFLOWD_SOCKET")
        monkeypatch.delenv("WORKFLOWD_CONFIG")
        assert find_socket(service_socket=service) == Path("here.sock")
        (tmp_path / "config.toml").unlink()
        with pytest.raises(NoSocket) as none:
            find_socket(service_socket=service)
        assert "--socket" in none.value.message and "WORKFLOWD_CONFIG" in none.value.message
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(service))
            assert find_socket(service_socket=service) == service

    def test_unit_directories(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """$RUNTIME_DIRECTORY is the shipped unit's /run/workflowd when it is not set."""
        conf = tmp_path / "c.toml"
        conf.write_text('[daemon]\nsocket = "$RUNTIME_DIRECTORY/workflowd.sock"\n')
        monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
        assert find_socket(None, conf) == Path("/run/workflowd/workflowd.sock")
        monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
        assert find_socket(None, conf) == tmp_path / "workflowd.sock"


class TestErrors:
    def test_one_class_per_code(self) -> None:
        """Every protocol error code has its own ClientError subclass with .code and .message."""
        assert set(ERRORS) == ERROR_CODES
        e = error_of({"ok": False, "error": {"code": "not_found", "message": "no workflow 'x'"}})
        assert isinstance(e, NotFound) and isinstance(e, ClientError)
        assert (e.code, e.message) == ("not_found", "no workflow 'x'")
        assert isinstance(error_of({"error": {"code": "conflict"}}), Conflict)
        assert isinstance(error_of({"error": {"code": "bad_input"}}), BadInput)
        odd = error_of({"error": {"code": "brand_new", "message": "m"}})
        assert type(odd) is ClientError and odd.code == "brand_new"
