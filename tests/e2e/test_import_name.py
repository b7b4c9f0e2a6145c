"""With another package's `daemon/__init__.py` (python-daemon's), both commands refuse in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
#: What python-daemon's package file looks like to an importer (its name and main class).
FOREIGN_INIT = '''"""Library to implement a well-behaved Unix daemon process."""

class DaemonContext:
    """Context for turning the current program into a daemon process."""
'''


def isolated(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `code` with `python -I` (no cwd, no PYTHONPATH on sys.path) in `cwd`."""
    argv = [sys.executable, "-I", "-c", code]
    return subprocess.run(argv, check=False, cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def hybrid(tmp_path: Path) -> Path:
    """A site folder where `daemon/` holds our modules under python-daemon's `__init__.py`.

    That is what pip leaves when both distributions are installed into one environment.
    """
    site = tmp_path / "site"
    package = site / "daemon"
    package.mkdir(parents=True)
    for entry in (CHECKOUT / "daemon").iterdir():
        if entry.name not in ("__init__.py", "__pycache__"):
            (package / entry.name).symlink_to(entry)
    (package / "__init__.py").write_text(FOREIGN_INIT)
    (site / "handlers").symlink_to(CHECKOUT / "handlers")
    return site


@pytest.mark.parametrize(
    ("prog", "module", "args"),
    [
        ("workflowd", "daemon.main", ["--config", "none.toml"]),
        ("workflowctl", "daemon.control.ctl", ["ping"]),
    ],
)
def test_foreign_daemon_package_exits_2(
    hybrid: Path, tmp_path: Path, prog: str, module: str, args: list[str]
) -> None:
    """`python -I` from a neutral folder, the hybrid first on sys.path: exit 2, one line."""
    neutral = tmp_path / "elsewhere"
    neutral.mkdir()
    code = (
        f"import sys; sys.path.insert(0, {str(hybrid)!r}); sys.argv[1:] = {args!r}\n"
        f"from {module} import main\n"
        "sys.exit(main())\n"
    )
    done = isolated(code, neutral)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: the import name 'daemon' is another package's")
    assert str(hybrid / "daemon") in lines[0]


def test_our_package_passes_the_check(tmp_path: Path) -> None:
    """The real package is recognised as ours (so the check above is not always refusing)."""
    code = "from daemon.identity import foreign_package; print(foreign_package())"
    done = isolated(code, tmp_path)
    assert done.stdout.strip() == "None", done.stderr
