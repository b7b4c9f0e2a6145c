"""Tells whether the import name `daemon` is this project's (PyPI's python-daemon uses it too)."""

from __future__ import annotations

import sys
from pathlib import Path


def foreign_package() -> str | None:
    """Return the folder of another package that took the name `daemon`, or None if it is ours.

    With python-daemon installed beside workflowd, pip merges both into one `daemon/` folder
    and one `__init__.py` wins: workflowd's own modules then import, but every workflow
    module fails on `from daemon import S`. Checked first thing, so the daemon and the
    client say so in one line instead.
    """
    package = sys.modules.get("daemon")
    if package is None:
        return None
    path = Path(getattr(package, "__file__", None) or "?")
    if path == Path(__file__).with_name("__init__.py") and "Workflow" in vars(package):
        return None
    return str(path.parent)


def refuse_foreign(prog: str) -> int | None:
    """Print one line and return exit code 2 when `daemon` is not ours; else return None."""
    where = foreign_package()
    if where is None:
        return None
    print(
        f"{prog}: the import name 'daemon' is another package's ({where}), not workflowd's: "
        "install workflowd into a virtualenv of its own (python-daemon shares the name)",
        file=sys.stderr,
    )
    return 2
