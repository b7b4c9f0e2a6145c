"""Runs the installed `workflowctl` as a subprocess, through a pipe or on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import anyio

from tests.helpers import REPO

#: Variables that would steer workflowctl from outside the test.
STEERING = ("WORKFLOWD_SOCKET", "WORKFLOWD_CONFIG", "NO_COLOR", "RUNTIME_DIRECTORY")


def workflowctl() -> list[str]:
    """Return the argv prefix of the installed console script (or the module)."""
    script = Path(sys.executable).parent / "workflowctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "daemon.control.ctl"]


def clean_env(**extra: str) -> dict[str, str]:
    """Return the environment without the variables that steer workflowctl, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    return {**env, **extra}


async def ctl(
    *args: str,
    socket: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess[bytes]:
    """Run workflowctl (with `--socket` if given) and return the finished process."""
    argv = [*workflowctl(), *(["--socket", str(socket)] if socket else []), *args]
    with anyio.fail_after(60):
        return await anyio.run_process(argv, check=False, cwd=cwd, env=env or clean_env())


def ok(done: subprocess.CompletedProcess[bytes]) -> str:
    """Return stdout of a run that succeeded quietly."""
    assert done.returncode == 0 and done.stderr == b"", (done.returncode, done.stderr.decode())
    return done.stdout.decode()


def failed(done: subprocess.CompletedProcess[bytes], code: int) -> str:
    """Return stderr of a run that exited `code` with nothing on stdout."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == b"", done.stdout
    return done.stderr.decode()


def on_terminal(*args: str, env: dict[str, str], cwd: Path = REPO) -> tuple[int, bytes]:
    """Run workflowctl on a pseudo-terminal (blocking; bounded by workflowctl's own timeout).

    Returns its exit status and everything it wrote to the terminal.
    """
    main, child = pty.openpty()
    try:
        proc = subprocess.Popen(
            [*workflowctl(), "--timeout", "20", *args],
            stdin=child,
            stdout=child,
            stderr=child,
            env=env,
            cwd=cwd,
        )
    finally:
        os.close(child)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(main)
    return proc.wait(timeout=30), b"".join(chunks)
