"""Runs a real `workflowd` process for end-to-end tests: its config, start, stop and log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from tests.helpers import REPO, postgres
from tests.helpers.client import Client, connect

__all__ = ["REPO", "Daemon", "run_workflowd", "running_daemon", "write_config"]


def write_config(tmp: Path, modules: list[str], **sections: dict[str, Any]) -> Path:
    """Write a config.toml for a test daemon under `tmp` and return its path."""
    conf: dict[str, dict[str, Any]] = {
        "daemon": {"socket": str(tmp / "wd.sock"), "shutdown_grace_s": 5.0},
        "store": {"path": str(tmp / "wd.db")},
        "workflows": {"paths": [str(REPO)], "modules": modules},
        "runtime": {"retry_initial_s": 0.05, "retry_max_s": 0.5},
        "log": {"level": "info", "format": "json"},
    }
    for name, values in sections.items():
        conf.setdefault(name, {}).update(values)
    if postgres.E2E.backend == "postgres" and "backend" not in conf["store"]:
        # `--store postgres`: the database stands in for the file, one per file a test names.
        store = conf["store"]
        store.update(backend="postgres", dsn=postgres.E2E.dsn_for(str(store.pop("path"))))
        store.pop("synchronous", None)
    lines = []
    for name, values in conf.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    """A `workflowd` subprocess on a config under a temporary folder."""

    def __init__(self, tmp: Path, config: Path, env: dict[str, str] | None = None) -> None:
        self.tmp, self.config = tmp, config
        self.socket = tmp / "wd.sock"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / "daemon.log"
        self.killed = False  # a SIGKILL was sent: a log line may have been cut short

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process without waiting for it to be ready."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.main", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.tmp,
            )
        return self.proc

    async def start(self) -> None:
        """Start the process and wait (bounded) until it answers ping."""
        proc = self.spawn()
        with anyio.fail_after(30):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"workflowd exited {proc.returncode}:\n{self.output()}")
                try:
                    async with connect(self.socket) as c:
                        if (await c.request("ping"))["ok"]:
                            return
                except OSError:
                    pass
                await anyio.sleep(0.02)

    def output(self) -> str:
        """Return everything the daemon printed so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def records(self) -> list[dict[str, Any]]:
        """Return the daemon's JSON log records.

        After a SIGKILL, a line the kill cut short is skipped (the process died mid-write);
        otherwise every line must parse.
        """
        out = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    if not self.killed:
                        raise
        return out

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send a signal and wait (bounded) for the process to exit; return its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.killed = self.killed or sig == signal.SIGKILL
            self.proc.send_signal(sig)
        with anyio.fail_after(30):
            while True:
                code = self.proc.poll()
                if code is not None:
                    return code
                await anyio.sleep(0.02)

    async def kill(self) -> None:
        """SIGKILL the daemon (a crash)."""
        await self.stop(signal.SIGKILL)

    @asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        """Open a client connection to this daemon."""
        async with connect(self.socket) as c:
            yield c


async def run_workflowd(
    config: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run workflowd to completion (for start-up failures); return exit code and stderr."""
    proc = await anyio.run_process(
        [sys.executable, "-m", "daemon.main", "--config", str(config)],
        cwd=cwd,
        check=False,
        env=env,
    )
    return proc.returncode, proc.stderr.decode()


@asynccontextmanager
async def running_daemon(
    tmp: Path, modules: list[str], env: dict[str, str] | None = None, **sections: dict[str, Any]
) -> AsyncIterator[Daemon]:
    """Start a real workflowd on a fresh config; stop it (SIGTERM, then SIGKILL) on exit."""
    d = Daemon(tmp, write_config(tmp, modules, **sections), env)
    await d.start()
    try:
        yield d
    finally:
        if d.proc is not None and d.proc.poll() is None:
            try:
                await d.stop()
            except TimeoutError:
                await d.kill()
