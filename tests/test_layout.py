"""The test suite keeps its own shape (tests/README.md): packages, no cross-imports, distinct names."""

from __future__ import annotations

import ast
import importlib.util
import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SOURCES = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def strings(tree: ast.AST) -> list[str]:
    """Return every string constant in a module."""
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


class TestLayout:
    def test_every_test_folder_is_a_package(self) -> None:
        """Test files with one basename in two folders do not collide (rootdir-based imports)."""
        folders = {p.parent for p in TESTS.rglob("test_*.py")}
        assert [str(f) for f in sorted(folders) if not (f / "__init__.py").exists()] == []

    def test_no_test_file_imports_another(self) -> None:
        """Fixtures live in tests/conftest.py and helpers in tests/helpers/, not in test files."""
        found = []
        for path in SOURCES:
            text = path.read_text()
            # Also in code a test runs in a child process (`python -c` strings).
            for m in re.finditer(r"^\s*(?:from|import)\s+([\w.]+)", text, re.MULTILINE):
                name = m.group(1)
                if re.search(r"(^|\.)test_\w+", name):
                    found.append(f"{path.relative_to(TESTS)}: {m.group(0).strip()}")
        assert found == []

    def test_module_paths_in_strings_exist(self) -> None:
        """A module path written as text (a config's modules, a child's import) still imports."""
        missing = []
        for path in SOURCES:
            for text in strings(ast.parse(path.read_text())):
                for name in re.findall(r"\btests(?:\.\w+)+", text):
                    if importlib.util.find_spec(name) is None:
                        missing.append(f"{path.relative_to(TESTS)}: {name}")
        assert missing == []

    def test_fixture_workflow_names_are_distinct(self) -> None:
        """No two fixture workflow modules define a workflow class of the same name."""
        names: Counter[str] = Counter()
        for path in sorted((TESTS / "workflows").glob("*.py")):
            tree = ast.parse(path.read_text())
            defined = {
                n.name
                for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef)
                and any(isinstance(b, ast.Name) and b.id == "Workflow" for b in n.bases)
            }
            # Module source kept as text (the reload tests' versions): versions of one class.
            for text in strings(tree):
                defined |= set(re.findall(r"^class (\w+)\(Workflow\):", text, re.MULTILINE))
            names.update(defined)
        assert names, "no fixture workflows found"
        assert [name for name, n in names.items() if n > 1] == []
