"""Running a Run step's command: its own process group, capped output, SIGTERM then SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import structlog

from daemon.core.command import KILL_AFTER_S, Run
from daemon.core.statements import NonRetryableError

log = structlog.get_logger()
#: Records a history entry of the workflow the step belongs to.
Note = Callable[[str, dict[str, Any]], None]
_CHUNK = 65536


class CommandFailed(Exception):
    """Raised when a command exits with a code not in its `ok_codes` (the step is retried)."""


class CommandTimeout(TimeoutError):
    """Raised when a command runs past its timeout and is killed (the step is retried)."""


class _Tail:
    """Keeps the last `limit` bytes written to it, and counts them all."""

    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.buf = limit, 0, bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


async def run_command(
    run: Run, *, note: Note, kill_after_s: float = KILL_AFTER_S
) -> dict[str, Any]:
    """Run the step's command to its end; return `{"exit_code", "stdout", "stderr"}`.

    Raise CommandFailed for an exit code not in `ok_codes`, CommandTimeout past `timeout`.
    However it ends (cancel and shutdown included), nothing of its process group is left:
    SIGTERM, then SIGKILL after `kill_after_s`. Every run is noted as `command_run`.
    """
    try:
        argv = run.command()
    except Exception as e:
        raise NonRetryableError(str(e)) from e
    env = {**os.environ, **run.env} if run.env is not None else None
    data = run.stdin.encode() if isinstance(run.stdin, str) else run.stdin
    out, err = _Tail(run.output_max_bytes), _Tail(run.output_max_bytes)
    # Pipes of our own rather than asyncio's: each is closed here whatever happens, even
    # when a pump is cancelled with unread output in it.
    out_r, out_w = _pipe("r")
    err_r, err_w = _pipe("r")
    in_r, in_w = _pipe("w") if data is not None else (subprocess.DEVNULL, -1)
    stdin = [in_w]  # _feed closes it once written (EOF for the command), else we do below
    began = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            cwd=run.cwd,
            env=env,
            start_new_session=True,  # its own process group: killed as a whole, never by our tty
        )
    except BaseException:
        _close(out_r, err_r, *stdin)
        raise
    finally:
        _close(out_w, err_w, in_r)
    outcome = "cancelled"
    try:
        with anyio.fail_after(run.timeout) if run.timeout else contextlib.nullcontext():
            async with anyio.create_task_group() as tg:
                tg.start_soon(_pump, out_r, out)
                tg.start_soon(_pump, err_r, err)
                if data is not None:
                    tg.start_soon(_feed, stdin, data)
                await proc.wait()
                # The leader is gone; what it left in its group would hold the pipes open.
                await _end_group(proc.pid, kill_after_s)
        outcome = "exited"
    except TimeoutError:
        outcome = "timeout"
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await _terminate(proc, kill_after_s)
                with anyio.move_on_after(1):  # what is still in the pipes, now no one writes
                    await _pump(out_r, out)
                    await _pump(err_r, err)
            finally:
                _close(out_r, err_r, *stdin)
            code = proc.returncode
            ms = round((time.monotonic() - began) * 1000, 3)
            record = {
                "step": run.name,
                "argv": argv,
                "exit_code": code,
                "outcome": outcome,
                "duration_ms": ms,
                "stdout": out.text(),
                "stderr": err.text(),
                "stdout_bytes": out.total,
                "stderr_bytes": err.total,
            }
            note("command_run", record)
            log.info("command_run", step=run.name, exit_code=code, outcome=outcome, duration_ms=ms)
    result = {"exit_code": code, "stdout": out.text(), "stderr": err.text()}
    if outcome == "timeout":
        raise CommandTimeout(
            f"command {argv[0]!r} ran over its timeout of {run.timeout:g} s and was killed"
        )
    if code not in run.ok_codes:
        last = err.text().strip().splitlines()[-1:] or [""]
        raise CommandFailed(
            f"command {argv[0]!r} exited with {_code_text(code)}"
            + (f": {last[0][:200]}" if last[0] else "")
        )
    return result


def _code_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal has no name
            return f"signal {-code}"
    return f"code {code}"


def _pipe(ours: str) -> tuple[int, int]:
    """Return a pipe's read and write ends; only `ours` ("r" or "w") is made non-blocking.

    The command's end stays blocking: the flag belongs to the open file, which it shares.
    """
    r, w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(r if ours == "r" else w, False)
    return r, w


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


async def _pump(fd: int, tail: _Tail) -> None:
    """Read `fd` to its end into `tail`."""
    while True:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        except OSError:  # closed already: nothing more to read
            return
        if not chunk:
            return
        tail.add(chunk)


async def _feed(stdin: list[int], data: bytes) -> None:
    """Write `data` to the command's stdin, then close it (a command may stop reading)."""
    fd, view = stdin[0], memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await anyio.wait_writable(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stdin[0] = -1
        os.close(fd)


async def _terminate(proc: asyncio.subprocess.Process, kill_after_s: float) -> None:
    """Stop the leader and its group: SIGTERM, then SIGKILL if still there after the grace."""
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGTERM)
        with anyio.move_on_after(kill_after_s):
            await proc.wait()
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
    await _end_group(proc.pid, kill_after_s)


async def _end_group(pgid: int, kill_after_s: float) -> None:
    """End what is left of a process group once its leader has exited."""
    if not group_alive(pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    # Not our children, so there is nothing to wait on: look again until they are gone.
    with anyio.move_on_after(kill_after_s):
        while group_alive(pgid):  # noqa: ASYNC110 - no event tells when a group is empty
            await anyio.sleep(0.02)
        return
    _signal_group(pgid, signal.SIGKILL)
    with anyio.move_on_after(1):
        while group_alive(pgid):  # noqa: ASYNC110 - as above
            await anyio.sleep(0.02)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Tell whether a process group still has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie member still counts for kill(); /proc tells it apart.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
