"""The dependency rules between modules hold (the engine does no I/O; the client is thin)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DAEMON = Path(__file__).resolve().parent.parent / "daemon"


def our_imports(module: str) -> set[str]:
    """Return the sibling modules `daemon/<module>.py` imports (relative or absolute)."""
    tree = ast.parse((DAEMON / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:
                found |= {a.name for a in node.names}
            elif node.level == 1:
                found.add(node.module or "")
            elif node.module and node.module.startswith("daemon."):
                found.add(node.module.removeprefix("daemon."))
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("daemon.") for a in node.names if a.name.startswith("daemon.")
            }
    return found


class TestLayers:
    """Which module may import which."""

    @pytest.mark.parametrize("module", ["engine", "statements", "state"])
    def test_engine_is_pure(self, module: str) -> None:
        """The engine modules import only each other and the leaf contracts."""
        allowed = {"errors", "handler", "state", "statements", "engine"}
        assert our_imports(module) <= allowed

    def test_ctl_imports_only_protocol(self) -> None:
        """workflowctl only builds requests and prints responses."""
        assert our_imports("ctl") <= {"protocol"}

    def test_handlers_import_only_contracts(self) -> None:
        """Handlers depend on the contracts, never on the runtime or the store."""
        for path in (DAEMON.parent / "handlers").glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("daemon."):
                    assert node.module in {"daemon.handler", "daemon.clock", "daemon.errors"}, path
