"""Finding the daemon from anywhere, --version, workflowd's --help and shell completion."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.helpers.ctl import clean_env, ctl, failed, ok, workflowctl
from tests.helpers.harness import running_daemon

MODULES = ["tests.workflows.ctl"]
#: A real service on this machine would be found as the last resort.
SERVICE_SOCKET_PRESENT = Path("/run/workflowd/workflowd.sock").exists()


def config(folder: Path, socket: Path) -> Path:
    """Write a config.toml in `folder` naming `socket`; return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(f'[daemon]\nsocket = "{socket}"\n')
    return path


class TestFindingTheDaemon:
    async def test_discovery_order(self, tmp_path: Path) -> None:
        """--socket, $WORKFLOWD_SOCKET, --config, $WORKFLOWD_CONFIG, then ./config.toml."""
        async with running_daemon(tmp_path, MODULES) as d:
            good = config(tmp_path / "good", d.socket)
            bad = config(tmp_path / "bad", tmp_path / "nothing-here.sock")
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            runs = {
                "socket": await ctl("ping", socket=d.socket, env=clean_env(WORKFLOWD_SOCKET="/x")),
                "env socket": await ctl(
                    "--config", str(bad), "ping", env=clean_env(WORKFLOWD_SOCKET=str(d.socket))
                ),
                "config": await ctl(
                    "--config", str(good), "ping", env=clean_env(WORKFLOWD_CONFIG=str(bad))
                ),
                "env config": await ctl(
                    "ping", cwd=bad.parent, env=clean_env(WORKFLOWD_CONFIG=str(good))
                ),
                "cwd": await ctl("ping", cwd=good.parent),
            }
            nothing = await ctl("ping", cwd=elsewhere)
        for how, done in runs.items():
            assert ok(done).startswith("workflowd "), how
        if not SERVICE_SOCKET_PRESENT:  # else the last place looked finds that one
            message = failed(nothing, 2)
            assert "--socket" in message and "WORKFLOWD_CONFIG" in message and "/run/" in message

    async def test_versions(self, tmp_path: Path) -> None:
        """Both commands print their version; workflowd's --help names the config it uses."""
        version = ok(await ctl("--version"))
        daemon = await anyio.run_process([sys.executable, "-m", "daemon.main", "--version"])
        env = clean_env(WORKFLOWD_CONFIG=str(tmp_path / "mine.toml"), COLUMNS="1000")
        helped = await anyio.run_process(
            [sys.executable, "-m", "daemon.main", "--help"], cwd=tmp_path, env=env
        )
        assert version.startswith("workflowctl 0.") and version.count("\n") == 1
        assert daemon.stdout.decode().startswith("workflowd 0.")
        assert f"here and now: {tmp_path / 'mine.toml'})" in helped.stdout.decode()


class TestCompletion:
    @pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
    async def test_scripts_parse(self, shell: str, tmp_path: Path) -> None:
        """`completion SHELL` prints a script its shell accepts (`-n`; skipped if absent)."""
        script = ok(await ctl("completion", shell))
        assert "workflowctl" in script
        binary = shutil.which(shell)
        if binary is None:
            pytest.skip(f"{shell} is not installed here")
        path = tmp_path / f"completion.{shell}"
        path.write_text(script)
        argv = [binary, "--no-execute", str(path)] if shell == "fish" else [binary, "-n", str(path)]
        checked = await anyio.run_process(argv, check=False)
        assert checked.returncode == 0, checked.stderr.decode()

    async def test_completes_commands_types_and_ids(self, tmp_path: Path) -> None:
        """Completion offers commands, options, workflow types and the daemon's workflow ids."""
        async with running_daemon(tmp_path, MODULES) as d:
            ok(await ctl("start", "Latch", "--id", "lat-1", socket=d.socket))

            def complete(line: str) -> set[str]:
                answer = tmp_path / "completions"
                env = clean_env(
                    _ARGCOMPLETE="1",
                    _ARGCOMPLETE_IFS="\n",
                    _ARGCOMPLETE_STDOUT_FILENAME=str(answer),
                    COMP_LINE=line,
                    COMP_POINT=str(len(line)),
                    WORKFLOWD_SOCKET=str(d.socket),
                )
                subprocess.run(workflowctl(), env=env, capture_output=True, check=False, timeout=30)
                words = answer.read_text().split("\n") if answer.exists() else []
                return {w.strip() for w in words if w.strip()}

            commands = await anyio.to_thread.run_sync(complete, "workflowctl wa")
            options = await anyio.to_thread.run_sync(complete, "workflowctl list --st")
            types = await anyio.to_thread.run_sync(complete, "workflowctl start Ve")
            ids = await anyio.to_thread.run_sync(complete, "workflowctl show lat")
        assert commands == {"wait"}
        assert options == {"--status"}
        assert types == {"Vetting"}
        assert ids == {"lat-1"}
