"""In-process test doubles: a Recorder handler, an in-memory driver for the engine, marks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pytest

from daemon import CallbackRequest, CheckpointType, State, Workflow, handle_callback, resume


@dataclass
class Recorder:
    """A real handler that logs every setup, handle and teardown call it receives."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    fail_setup: bool = False
    fail_handle: bool = False
    fail_teardown: bool = False
    type: str = "recorder"

    async def setup(self, req: CallbackRequest) -> str:
        """Record the call and return setup data naming the event."""
        self.calls.append(("setup", req.name))
        if self.fail_setup:
            raise RuntimeError("setup broke")
        return f'{{"armed": "{req.name}"}}'

    async def handle(self, req: CallbackRequest, input: Any) -> Any:
        """Record the call and echo the input."""
        self.calls.append(("handle", req.name))
        if self.fail_handle:
            raise ValueError("bad input")
        return {"echo": input}

    async def teardown(self, req: CallbackRequest, handled: bool) -> None:
        """Record the call (with whether this case fired)."""
        self.calls.append(("teardown" if not handled else "teardown_handled", req.name))
        if self.fail_teardown:
            raise RuntimeError("teardown broke")


W = TypeVar("W", bound=Workflow)


class Driver(Generic[W]):
    """Runs one workflow in memory with a checkpoint that records its kinds."""

    def __init__(self, wf: W, id: str = "wf-1") -> None:
        self.wf = wf
        self.state = State.new(id, type(wf).name)
        self.checkpoints: list[CheckpointType] = []

    async def checkpoint(self, kind: CheckpointType) -> None:
        """Record the checkpoint kind."""
        self.checkpoints.append(kind)

    async def resume(self) -> None:
        """Resume the workflow until it blocks."""
        await resume(self.wf, self.state, self.checkpoint)

    async def send(self, name: str, input: Any = None, **kw: Any) -> Any:
        """Deliver a callback, then resume."""
        out = await handle_callback(CallbackRequest(name=name, **kw), self.wf, self.state, input)
        await self.resume()
        return out


#: Tests that drop privileges to another uid with setpriv.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)


def _other_uids_reach_the_venv() -> bool:
    """Tell whether an unprivileged uid can run this interpreter and import the checkout."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    probe = [*drop, sys.executable, "-c", "import daemon"]
    return subprocess.run(probe, capture_output=True, check=False, timeout=60).returncode == 0


#: Tests that run workflowd itself as another uid: that uid must reach the checkout's venv
#: (a checkout under a private folder such as /root is not; .ci/run opens the path up).
runs_daemon_as_other_uid = pytest.mark.skipif(
    not _other_uids_reach_the_venv(),
    reason="needs root, setpriv, and a checkout other uids can reach (not under a 0700 folder)",
)
