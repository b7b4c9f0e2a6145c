"""The folders of `daemon/` are layers: imports run down only, and no module imports itself back.

The import graph is computed from the modules' source (every `import` and `from ... import`,
lazy and TYPE_CHECKING ones included), not from a hand-written list.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

TOP = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "handlers")

#: What each layer may import besides itself. `daemon` is the author API (`__init__.py`).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "clock": set(),
    "wake": set(),
    "identity": set(),
    "core": {"errors", "clock"},
    "observe": {"errors", "clock", "core"},
    "store": {"errors", "clock", "core", "observe", "wake"},
    "service": {"errors", "clock", "core", "observe"},
    "handlers": {"errors", "clock", "core"},
    "runtime": {"errors", "clock", "core", "store", "observe", "wake"},
    "ops": {"errors", "clock", "core", "store", "runtime", "service"},
    "control": {"errors", "clock", "identity", "core", "store", "runtime", "ops", "service"},
    "http": {"errors", "clock", "core", "store", "runtime", "ops", "service", "observe"},
    "daemon": {"errors", "core"},
    # daemon/client.py re-exports daemon.control.client for the programs that send events.
    "client": {"control"},
    "examples": {"core", "handlers"},
    "main": {
        "errors",
        "clock",
        "identity",
        "core",
        "store",
        "runtime",
        "ops",
        "service",
        "control",
        "observe",
        "http",
    },
}
#: Standard and third-party modules that do I/O: the engine never imports them.
IO_MODULES = {
    "aiosqlite", "anyio", "asyncio", "io", "os", "pathlib", "shutil", "socket", "sqlite3",
    "structlog", "subprocess", "sys", "tempfile", "threading", "watchfiles",
}  # fmt: skip


def module_name(path: Path) -> str:
    """Return the dotted module name of a source file under the checkout."""
    parts = list(path.relative_to(TOP).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Map every module of our packages to its file."""
    found = {}
    for package in PACKAGES:
        for path in sorted((TOP / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


@cache
def raw_imports(module: str) -> frozenset[str]:
    """Return every absolute module name `module` imports, ours and others'."""
    path = modules()[module]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            found.add(base)
            # `from daemon.control import protocol` imports the module daemon.control.protocol.
            found |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules()}
    return frozenset(found)


def our_imports(module: str) -> set[str]:
    """Return the modules of ours that `module` imports (a package stands for its __init__)."""
    ours = modules()
    return {m for m in raw_imports(module) if m in ours and m != module}


def layer(module: str) -> str:
    """Return the layer a module belongs to: its folder under daemon/, or its own name."""
    parts = module.split(".")
    if parts[0] == "handlers":
        return "handlers"
    return parts[1] if len(parts) > 1 else "daemon"


def cycles() -> list[list[str]]:
    """Return the import cycles (strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in our_imports(m):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(modules()):
        if m not in index:
            visit(m)
    return found


class TestGraph:
    """The import graph of daemon/ and handlers/."""

    def test_graph_is_read(self) -> None:
        """The graph holds the modules and edges we know of (so the checks below can fail)."""
        assert {"daemon.core.engine", "daemon.runtime.actor", "handlers.timer"} <= set(modules())
        assert "daemon.core.state" in our_imports("daemon.core.engine")
        assert "daemon.control.protocol" in our_imports("daemon.control.ctl")

    def test_cycle_finder_finds_a_cycle(self) -> None:
        """A circle planted in the graph is reported."""
        ours = our_imports
        try:
            globals()["our_imports"] = lambda m: (
                ours(m) | ({"daemon.core.engine"} if m == "daemon.core.state" else set())
            )
            planted = {"daemon.core.engine", "daemon.core.state"}
            assert any(planted <= set(c) for c in cycles())
        finally:
            globals()["our_imports"] = ours

    def test_no_import_cycles(self) -> None:
        """No module imports itself back through others."""
        assert cycles() == []

    @pytest.mark.parametrize("module", sorted(modules()))
    def test_imports_run_down(self, module: str) -> None:
        """Each module imports only its own layer and the layers below it."""
        mine = layer(module)
        wrong = {m for m in our_imports(module) if layer(m) not in ALLOWED[mine] | {mine}}
        assert not wrong, f"{module} ({mine}) imports up or sideways: {sorted(wrong)}"


class TestRules:
    """The rules a layer keeps beyond its place."""

    @pytest.mark.parametrize("module", sorted(m for m in modules() if layer(m) == "core"))
    def test_core_does_no_io(self, module: str) -> None:
        """The engine imports nothing that does I/O (it gets checkpoints and steps injected)."""
        roots = {m.split(".")[0] for m in raw_imports(module)}
        assert not roots & IO_MODULES, f"{module} imports {sorted(roots & IO_MODULES)}"

    def test_ctl_imports_only_protocol(self) -> None:
        """workflowctl only builds requests and prints responses (and checks it is ours)."""
        thin = {
            "daemon.control.protocol",
            "daemon.control.client",
            "daemon.control.render",
            "daemon.control",
            "daemon.identity",
        }
        assert our_imports("daemon.control.ctl") <= thin

    def test_client_imports_only_protocol(self) -> None:
        """The Python client speaks the protocol and nothing else of the daemon's."""
        assert our_imports("daemon.control.client") <= {"daemon.control.protocol", "daemon.control"}
        client = {"daemon.control.client", "daemon.control.protocol", "daemon.control"}
        assert our_imports("daemon.control.aclient") <= client
        assert our_imports("daemon.client") <= client | {"daemon.control.aclient"}
        assert our_imports("daemon.control.render") <= set()

    def test_actor_is_private_to_the_runtime(self) -> None:
        """Only the runtime layer knows the actor."""
        users = {m for m in modules() if "daemon.runtime.actor" in our_imports(m)}
        assert {layer(m) for m in users} <= {"runtime"}

    def test_api_is_reexports_only(self) -> None:
        """daemon/__init__.py holds imports and __all__, nothing else."""
        tree = ast.parse((TOP / "daemon" / "__init__.py").read_text())
        for node in tree.body:
            is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            is_all = isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"
            assert is_doc or is_all or isinstance(node, ast.ImportFrom), ast.unparse(node)


class TestReadme:
    """The README's "Where things live" follows the folders."""

    def test_every_module_is_named_in_its_row(self) -> None:
        """Each layer's row in the README names every module of that folder."""
        text = (TOP / "README.md").read_text()
        section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
        rows = {
            line.split("|")[1].strip().strip("`"): line
            for line in section.splitlines()
            if line.startswith("| `")
        }
        for folder in sorted(
            p for p in (TOP / "daemon").iterdir() if (p / "__init__.py").is_file()
        ):
            row = rows.get(f"daemon/{folder.name}/")
            assert row is not None, f"no row for daemon/{folder.name}/"
            for path in folder.glob("*.py"):
                if path.stem != "__init__":
                    assert f"`{path.stem}`" in row, f"daemon/{folder.name}/{path.name}"
