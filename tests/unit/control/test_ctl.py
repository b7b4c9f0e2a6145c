"""Tests for workflowctl, run as a real subprocess against a real control socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from daemon.control.ctl import answer_timeout, build_parser, build_request
from daemon.control.protocol import Cancel, History, List, Logs, Ping, Send, Show, Start
from daemon.control.render import cell, show, table
from tests.helpers import REPO
from tests.helpers.memory import MemoryBackend, serving


async def ctl(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> Any:
    """Run workflowctl with `args` and return the finished process."""
    environ = {k: v for k, v in os.environ.items() if k != "WORKFLOWD_SOCKET"}
    environ["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "daemon.control.ctl", *args]
    with anyio.fail_after(30):
        return await anyio.run_process(argv, check=False, cwd=cwd, env=environ | (env or {}))


def out(done: subprocess.CompletedProcess[bytes]) -> str:
    """Return the process's stdout as text, checking it succeeded quietly."""
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""
    return done.stdout.decode()


class TestCommands:
    async def test_ping(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """Ping prints the version and counts, or the raw result with --json."""
        async with serving(backend, short_tmp / "s") as path:
            text = out(await ctl("--socket", str(path), "ping"))
            raw = out(await ctl("ping", "--json", "--socket", str(path)))
        assert text.startswith("workflowd ") and text.endswith(": 1 Waiting\n")
        assert msgspec.json.decode(raw)["workflows"] == {"Waiting": 1}

    async def test_start_then_inspect(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """A workflow started with an id and input shows up in list, show and history."""
        async with serving(backend, short_tmp / "s") as path:
            s = ("--socket", str(path))
            assert out(await ctl(*s, "start", "approval", "--id", "x", "--input", '{"n": 1}')) == (
                "x: Waiting for approve, reject, crash, odd\n"
            )
            listing = out(await ctl(*s, "list", "--status", "waiting")).splitlines()
            shown = msgspec.json.decode(out(await ctl(*s, "show", "x", "--json")))
            history = out(await ctl(*s, "history", "x")).splitlines()
            cut = await ctl(*s, "--json", "list", "--limit", "1")
            rows = msgspec.json.decode(cut.stdout)
        assert listing[0].split() == [
            "WORKFLOW_ID",
            "WORKFLOW",
            "STATUS",
            "UPDATED_AT",
            "WAITING_FOR",
        ]
        assert [line.split()[0] for line in listing[1:]] == ["x", "wf-1"]
        assert listing[1].index("Waiting") == listing[0].index("STATUS")  # columns line up
        assert shown["data"] == {"n": 1}
        assert history == ["AT  KIND     THREAD  SEQ  DETAIL", '    started          1    {"n":1}']
        assert [r["workflow_id"] for r in rows] == ["x"]
        # stdout holds exactly the rows; the cut list says so on stderr, as without --json.
        assert cut.returncode == 0 and cut.stderr.decode().startswith("… 1 shown; more: ")

    async def test_send(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """Send prints the handler's output as JSON; --no-wait only says it is queued."""
        async with serving(backend, short_tmp / "s") as path:
            s = ("--socket", str(path))
            reply = out(await ctl(*s, "send", "wf-1", "approve", "--input", '"ann"', "--pc", "7"))
            await ctl(*s, "start", "approval", "--id", "y")
            other_thread = await ctl(*s, "send", "y", "reject", "--thread", "t2")
            queued = out(await ctl(*s, "--json", "send", "y", "reject", "--no-wait"))
        assert msgspec.json.decode(reply) == {"handled": "approve", "input": "ann"}
        assert "\n  " in reply  # pretty-printed
        assert msgspec.json.decode(queued) == {"queued": True}
        assert other_thread.returncode == 1 and b"error: not_found" in other_thread.stderr

    async def test_cancel(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """Cancel prints the new status."""
        async with serving(backend, short_tmp / "s") as path:
            assert out(await ctl("--socket", str(path), "cancel", "wf-1")) == "wf-1: Cancelled\n"
        assert backend.workflows["wf-1"]["status"] == "Cancelled"


class TestExitCodes:
    async def test_error_reply(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """An error reply exits 1 with `error: code: message` on stderr."""
        async with serving(backend, short_tmp / "s") as path:
            done = await ctl("--socket", str(path), "send", "wf-1", "approve", "--pc", "2")
        assert done.returncode == 1 and done.stdout == b""
        assert done.stderr.decode().startswith("error: stale: ")

    async def test_usage_errors(self, short_tmp: Path) -> None:
        """A bad command or bad --input JSON exits 2 without a traceback."""
        for args in (
            ["dance"],
            ["start", "x", "--input", "{oops"],
            ["start", "x", "--input", "[1]"],
        ):
            done = await ctl("--socket", str(short_tmp / "s"), *args)
            assert done.returncode == 2 and b"Traceback" not in done.stderr

    async def test_unreachable(self, short_tmp: Path) -> None:
        """No socket, or a socket nobody listens on, exits 3 with one clear line."""
        missing = await ctl("--socket", str(short_tmp / "s"), "ping")
        with socket.socket(socket.AF_UNIX) as dead:
            dead.bind(str(short_tmp / "dead"))
        refused = await ctl("--socket", str(short_tmp / "dead"), "ping")
        for done in (missing, refused):
            lines = done.stderr.decode().splitlines()
            assert done.returncode == 3 and len(lines) == 1
            assert lines[0].startswith("workflowctl: cannot reach workflowd at ")

    async def test_daemon_busy(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """A daemon at its connection limit answers `unavailable`, which exits 1."""
        async with (
            serving(backend, short_tmp / "s", max_connections=1) as path,
            await anyio.connect_unix(path),  # takes the only slot
        ):
            done = await ctl("--socket", str(path), "ping")
        assert done.returncode == 1 and done.stderr.decode().startswith("error: unavailable:")

    async def test_daemon_hangs_up(self, short_tmp: Path) -> None:
        """A peer that closes the connection without answering counts as unreachable."""
        async with await anyio.create_unix_listener(short_tmp / "s") as listener:

            async def hang_up() -> None:
                stream = await listener.accept()
                await stream.aclose()

            async with anyio.create_task_group() as tg:
                tg.start_soon(hang_up)
                done = await ctl("--socket", str(short_tmp / "s"), "ping")
        lines = done.stderr.decode().splitlines()  # "closed the connection" or "reset by peer"
        assert done.returncode == 3 and len(lines) == 1
        assert lines[0].startswith("workflowctl: cannot reach workflowd at ")


class TestTimeout:
    async def test_silent_daemon(self, short_tmp: Path) -> None:
        """A daemon that takes the request and never answers: exit 3 once --timeout passes."""
        async with await anyio.create_unix_listener(short_tmp / "s") as listener:
            taken = []

            async def take_and_hold() -> None:
                taken.append(await listener.accept())  # read nothing, answer nothing

            async with anyio.create_task_group() as tg:
                tg.start_soon(take_and_hold)
                done = await ctl("--socket", str(short_tmp / "s"), "ping", "--timeout", "0.3")
            for stream in taken:
                await stream.aclose()
        assert done.returncode == 3
        where = f"workflowctl: cannot reach workflowd at {short_tmp / 's'}"
        assert done.stderr.decode().splitlines() == [f"{where}: no answer within 0.3 s (--timeout)"]

    @pytest.mark.parametrize(
        ("argv", "seconds"),
        [
            (["ping"], 60.0),
            (["logs"], 60.0),
            (["send", "w", "e"], 60.0),
            (["logs", "-f"], None),
            (["--timeout", "5", "logs", "-f"], 5.0),
            (["show", "w", "--timeout", "2.5"], 2.5),
            (["--timeout", "0", "ping"], None),
        ],
    )
    def test_defaults(self, argv: list[str], seconds: float | None) -> None:
        """60 s for every command, none for `logs -f`; 0 waits forever."""
        assert answer_timeout(build_parser().parse_args(argv)) == seconds

    async def test_bad_value(self) -> None:
        """A negative or non-numeric --timeout is a usage error."""
        for value in ("-1", "soon", "nan"):
            done = await ctl("--socket", "/nonexistent", "--timeout", value, "ping")
            assert done.returncode == 2 and b"--timeout" in done.stderr


class TestSocketPath:
    async def test_environment(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """$WORKFLOWD_SOCKET is used when --socket is not given."""
        async with serving(backend, short_tmp / "s") as path:
            done = await ctl("ping", env={"WORKFLOWD_SOCKET": str(path)})
        assert out(done).startswith("workflowd ")

    async def test_config_file(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """[daemon] socket of the config is resolved against the config file's folder."""
        (short_tmp / "conf").mkdir()
        (short_tmp / "conf" / "config.toml").write_text('[daemon]\nsocket = "../run/s"\n')
        async with serving(backend, short_tmp / "run" / "s"):
            by_option = await ctl("--config", str(short_tmp / "conf" / "config.toml"), "ping")
            by_default = await ctl("ping", cwd=short_tmp / "conf")
        assert out(by_option).startswith("workflowd ")
        assert out(by_default).startswith("workflowd ")

    async def test_config_default_and_directory_variables(
        self, backend: MemoryBackend, short_tmp: Path
    ) -> None:
        """Without [daemon] socket the default applies; $RUNTIME_DIRECTORY is expanded."""
        (short_tmp / "config.toml").write_text("[store]\n")
        (short_tmp / "other.toml").write_text('[daemon]\nsocket = "$RUNTIME_DIRECTORY/w.sock"\n')
        async with serving(backend, short_tmp / "state" / "workflowd.sock"):
            default = await ctl("ping", cwd=short_tmp)
        async with serving(backend, short_tmp / "w.sock"):
            env = {"RUNTIME_DIRECTORY": str(short_tmp)}
            expanded = await ctl("--config", "other.toml", "ping", cwd=short_tmp, env=env)
        unset = await ctl("--config", "other.toml", "ping", cwd=short_tmp)
        assert out(default).startswith("workflowd ")
        assert out(expanded).startswith("workflowd ")
        # Unset, it is what the shipped unit makes it: /run/workflowd.
        assert unset.returncode == 3 and b"/run/workflowd/w.sock" in unset.stderr

    async def test_missing_config(self, short_tmp: Path) -> None:
        """No socket option, variable or config file exits 2 and says what to pass."""
        done = await ctl("ping", cwd=short_tmp)
        assert done.returncode == 2 and b"--socket" in done.stderr


class TestLogs:
    async def test_recent(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """Logs prints the kept records of one workflow, one per line."""
        backend.emit("step_done", workflow_id="wf-1", step="a", level="info")
        backend.emit("other", workflow_id="wf-2")
        async with serving(backend, short_tmp / "s") as path:
            text = out(await ctl("--socket", str(path), "logs", "--workflow", "wf-1"))
            raw = out(await ctl("--socket", str(path), "logs", "--json"))
        assert text == "info    step_done workflow_id=wf-1 step=a\n"
        assert [msgspec.json.decode(line)["event"] for line in raw.splitlines()] == [
            "step_done",
            "other",
        ]

    async def test_follow_until_interrupted(self, backend: MemoryBackend, short_tmp: Path) -> None:
        """logs -f prints new records as they come and exits 130 quietly on Ctrl-C."""
        backend.emit("before")
        async with serving(backend, short_tmp / "s") as path:
            argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(path), "logs", "-f"]
            async with await anyio.open_process(argv, cwd=REPO) as process:
                assert process.stdout is not None and process.stderr is not None
                lines = BufferedByteReceiveStream(process.stdout)
                with anyio.fail_after(30):
                    assert await lines.receive_until(b"\n", 1000) == b"before"
                    backend.emit("after", n=1)
                    assert await lines.receive_until(b"\n", 1000) == b"after n=1"
                    process.send_signal(signal.SIGINT)
                    assert await process.wait() == 130
                errors = b"".join([chunk async for chunk in process.stderr])
        assert errors == b""


class TestBuildRequest:
    @pytest.mark.parametrize(
        ("argv", "expected"),
        [
            (["ping"], Ping(id=1)),
            (
                ["start", "W", "--id", "i", "--input", "{}"],
                Start(id=1, workflow="W", workflow_id="i", input={}),
            ),
            (
                ["send", "i", "e", "--input", "3", "--no-wait", "--thread", "t", "--pc", "4"],
                Send(id=1, workflow_id="i", event="e", input=3, thread_id="t", pc=4, wait=False),
            ),
            (
                ["list", "--status", "failed", "--workflow", "W", "--limit", "5"],
                List(id=1, status="Failed", workflow="W", limit=5),
            ),
            (["show", "i"], Show(id=1, workflow_id="i")),
            (["history", "i", "--limit", "7"], History(id=1, workflow_id="i", limit=7)),
            (["cancel", "i"], Cancel(id=1, workflow_id="i")),
            (["logs", "-f", "--workflow", "i"], Logs(id=1, follow=True, workflow_id="i")),
            (
                ["--timeout", "9", "start", "W", "--timeout", "60"],
                Start(id=1, workflow="W", timeout_s=60.0),
            ),
            (["list", "--parent", "p"], List(id=1, parent="p")),
        ],
    )
    def test_every_option_reaches_the_request(self, argv: list[str], expected: Any) -> None:
        """Each command's options land in the matching request fields."""
        assert build_request(build_parser().parse_args(argv)) == expected

    def test_start_timeout_is_the_deadline(self) -> None:
        """After `start`, --timeout is the deadline; before it, the wait for the answer."""
        args = build_parser().parse_args(["--timeout", "9", "start", "W", "--timeout", "60"])
        assert (args.timeout, args.timeout_s) == (9.0, 60.0)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["start", "W", "--timeout", "0"])


class TestFormatting:
    def test_cells(self) -> None:
        """Cells show lists of names plainly and anything else as compact JSON on one line."""
        assert cell(None) == ""
        assert cell(["a", "b"]) == "a, b"
        assert cell({"k": [1]}) == '{"k":[1]}'
        assert cell("two\nlines") == "two\\nlines"
        local = datetime.fromtimestamp(0.5).astimezone()
        assert cell(0.5, "updated_at") == local.strftime("%Y-%m-%d %H:%M:%S %z")
        assert cell("2024-01-01", "at") == "2024-01-01"

    def test_control_characters_are_escaped(self) -> None:
        """A command's output with escape sequences never reaches the terminal raw."""
        assert cell("\x1b[31mred\x07\x9b") == "\\x1b[31mred\\x07\\x9b"

    def test_plain_text_reply(self) -> None:
        """A handler reply that is a string prints as is; anything else as indented JSON."""
        assert show("send", "approved by ann") == "approved by ann"
        assert show("send", {"a": 1}) == '{\n  "a": 1\n}'

    def test_table_aligns_columns(self) -> None:
        """Every column starts at the same offset on every line."""
        text = table([{"a": "long value", "b": 1}, {"a": "x"}], ["a", "b"])
        header, first, second = text.splitlines()
        assert header.index("B") == first.index("1")
        assert second == "x"

    def test_reload_names_restart_keys_and_held_workflows(self) -> None:
        """An accepted reload says which keys need a restart and which workflows stay held."""
        result = {
            "reloaded": True,
            "workflows": ["Memo"],
            "needs_restart": ["store.history_keep", "log.format"],
            "incompatible": [{"workflow_id": "m1", "workflow": "Memo", "reason": "gone\nhere"}],
            "incompatible_count": 1,
        }
        assert show("reload", result).splitlines() == [
            "reloaded: Memo",
            "needs a restart: store.history_keep, log.format",
            "still held, 1 workflow(s) do not fit the new code:",
            "  m1 (Memo): gone\\nhere",
        ]
        plain = {"reloaded": True, "workflows": ["Memo"], "needs_restart": [], "incompatible": []}
        assert show("reload", plain) == "reloaded: Memo"
