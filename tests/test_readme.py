"""The README's tour workflow is real code: it runs as the README says."""

from __future__ import annotations

import re
import sys
import types
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from daemon import Workflow, WorkflowStatus
from tests.helpers.support import Driver

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_module() -> types.ModuleType:
    """Execute the README's first Python block as a module."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert code is not None
    module = types.ModuleType("readme_tour")
    sys.modules[module.__name__] = module
    exec(compile(code.group(1), str(README), "exec"), module.__dict__)  # noqa: S102 - our own README
    return module


class TestReadme:
    """The tour in README.md."""

    async def test_backup_tour_runs(self) -> None:
        """The Backup workflow waits for its file, takes an approval, then copies three times."""
        backup: Any = readme_module().Backup
        assert issubclass(backup, Workflow)
        d = Driver(backup())
        await d.resume()
        assert d.state.status is WorkflowStatus.WAITING
        await d.send("dump_ready", {"path": "/srv/dumps/ready", "change": "exists"})
        reply = await d.send("decide", {"approve": True, "by": "ann"})
        assert reply == "noted, ann"
        assert d.wf.copies == 3
        assert d.state.status == WorkflowStatus.FINISHED  # type: ignore[comparison-overlap]

    def test_schedule_in_the_tour(self) -> None:
        """The tour's Schedule is valid and fires at 02:30 Berlin time, DST rules included."""
        nightly: Any = readme_module().nightly
        assert nightly.next_fire(datetime(2024, 3, 30, 12, tzinfo=UTC)) == datetime(
            2024, 3, 31, 1, 0, tzinfo=UTC
        )  # 02:30 does not exist that night: 03:00 CEST
