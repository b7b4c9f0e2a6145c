"""workflowctl's output for people against a real daemon: show, list, history, errors, terminals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio

from tests.helpers import REPO
from tests.helpers.ctl import clean_env, ctl, failed, ok, on_terminal
from tests.helpers.harness import running_daemon
from tests.helpers.wait import shown_when, wait_status

MODULES = ["tests.workflows.ctl"]
#: A local time with its UTC offset, as every human table prints it.
LOCAL_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}"


class TestShow:
    async def test_describes_threads_waits_and_data(self, tmp_path: Path) -> None:
        """show says where each thread stands and when its timer fires; no epoch floats."""
        async with running_daemon(tmp_path, MODULES) as d:
            ok(
                await ctl(
                    "start", "Vetting", "--id", "v", "--input", '{"request": "r"}', socket=d.socket
                )
            )
            text = ok(await ctl("show", "v", socket=d.socket))
            raw = json.loads(ok(await ctl("show", "v", "--json", socket=d.socket)))
        lines = text.splitlines()
        assert lines[0] == "v  Vetting  Waiting"
        assert re.fullmatch(rf"created  {LOCAL_TIME}  \(\d+ s ago\)", lines[1]), lines[1]
        assert re.search(r"_main_ +waits at await_decision", text)
        assert re.search(r"notes:notes +waits at await_note", text)
        assert "decide: `workflowctl send v decide`" in text
        assert re.search(r"expired: timer fires in (59|60) min, at ([-\d]{10} )?[:\d]{8}", text), (
            text
        )
        assert '    "request": "r",' in lines  # the data, indented JSON
        assert not re.search(r"\d{10}\.\d", text)  # no Unix seconds
        assert "setup_data" not in text and '\\"' not in text  # no JSON inside strings
        assert isinstance(raw["updated_at"], float) and raw["state"]["threads"]

    async def test_retry_state_and_error(self, tmp_path: Path) -> None:
        """A failing step shows its attempt, its limit, when it runs next and the error."""
        async with running_daemon(tmp_path, MODULES) as d:
            ok(await ctl("start", "Wobbly", "--id", "w", socket=d.socket))
            async with d.client() as c:
                await shown_when(c, "w", lambda s: s["attempt"] >= 1)
            text = ok(await ctl("show", "w", socket=d.socket))
        assert re.search(r"retry    step wobble: attempt 1 of 6, next in \d+ s", text), text
        assert "error    step 'wobble' failed: RuntimeError: still wobbly" in text


class TestList:
    async def test_checked_options(self, tmp_path: Path) -> None:
        """--status is one of the real statuses in any case; a bad one or --limit is exit 2."""
        async with running_daemon(tmp_path, MODULES) as d:
            s = d.socket
            for wid in ("a", "b", "c"):
                ok(await ctl("start", "Latch", "--id", wid, socket=s))
            lower = ok(await ctl("list", "--status", "waiting", socket=s))
            bogus = await ctl("list", "--status", "Bogus", socket=s)
            too_many = await ctl("list", "--limit", "100000", socket=s)
            none = await ctl("list", "--limit", "0", socket=s)
            cut = await ctl("list", "--limit", "2", socket=s)
            by_type = ok(await ctl("list", "--workflow", "Vetting", socket=s))
        assert [line.split()[0] for line in lower.splitlines()[1:]] == ["c", "b", "a"]
        assert re.search(rf"Waiting +{LOCAL_TIME}", lower)
        assert "no status 'Bogus'" in failed(bogus, 2) and "Waiting" in bogus.stderr.decode()
        assert "--limit" in failed(too_many, 2) and "--limit" in failed(none, 2)
        assert cut.returncode == 0 and len(cut.stdout.splitlines()) == 3
        assert re.fullmatch(
            r"… 2 of 3 shown; more: workflowctl list --cursor \S+\n", cut.stderr.decode()
        )
        assert by_type == "no workflows\n"

    async def test_since(self, tmp_path: Path) -> None:
        """--since keeps the workflows changed that recently."""
        async with running_daemon(tmp_path, MODULES) as d:
            ok(await ctl("start", "Latch", "--id", "a", socket=d.socket))
            recent = ok(await ctl("list", "--since", "1d", socket=d.socket))
            old = ok(await ctl("list", "--since", "0s", socket=d.socket))
            bad = await ctl("list", "--since", "soon", socket=d.socket)
        assert len(recent.splitlines()) == 2 and old == "no workflows\n"
        assert "--since" in failed(bad, 2)


class TestHistoryAndSend:
    async def test_finished_row_thread_column_and_queued(self, tmp_path: Path) -> None:
        """history ends with `finished` and names each row's thread; send --no-wait says queued."""
        async with running_daemon(tmp_path, MODULES) as d:
            s = d.socket
            ok(await ctl("start", "Vetting", "--id", "v", socket=s))
            assert ok(await ctl("send", "v", "note", "--input", '"n"', "--no-wait", socket=s)) == (
                "queued\n"
            )
            async with d.client() as c:
                await shown_when(c, "v", lambda x: x["data"]["notes"] == ["n"])
            ok(await ctl("send", "v", "decide", "--input", '{"approve": false}', socket=s))
            async with d.client() as c:
                await wait_status(c, "v", "Finished")
            text = ok(await ctl("history", "v", socket=s))
        lines = text.splitlines()
        assert lines[0].split()[:3] == ["AT", "KIND", "THREAD"]
        kinds = {line.split()[3]: line for line in lines[1:]}
        assert list(kinds)[-1] == "finished"
        assert re.search(r"callback_received +notes:notes +note\b", text), text
        assert re.search(r"callback_received +_main_ +decide\b", text), text


class TestErrors:
    async def test_messages_name_what_exists(self, tmp_path: Path) -> None:
        """Wrong events, threads, ids and types get a message naming what there is."""
        async with running_daemon(tmp_path, [*MODULES, "daemon.examples"]) as d:
            s = d.socket
            ok(await ctl("start", "Approval", "--id", "ap", socket=s))
            an = await ctl("start", "Latch", "--id", "ap", socket=s)
            ok(await ctl("start", "Vetting", "--id", "v", socket=s))
            ok(await ctl("start", "Latch", "--id", "l", socket=s))
            event = await ctl("send", "v", "nosuch", socket=s)
            thread = await ctl("send", "v", "decide", "--thread", "zz", socket=s)
            other = await ctl("start", "Latch", "--id", "v", socket=s)
            logs = await ctl("logs", "--workflow", "nope", socket=s)
            ok(await ctl("send", "l", "open", socket=s))
            async with d.client() as c:
                await wait_status(c, "l", "Finished")
            cancel = await ctl("cancel", "l", socket=s)
        assert "does not wait for 'nosuch'; it waits for: decide, expired, note" in failed(event, 1)
        assert "no thread 'zz' (threads: _main_, notes:notes)" in failed(thread, 1)
        assert "exists and is a Vetting, not a Latch" in failed(other, 1)
        assert "exists and is an Approval, not a Latch" in failed(an, 1)
        assert failed(logs, 1) == "error: not_found: no workflow 'nope'\n"
        assert failed(cancel, 1).startswith("error: conflict: workflow l has already ended")

    async def test_reload_names_the_module_that_fails(self, tmp_path: Path) -> None:
        """A reload refused for a module that does not import names that module."""
        mods = tmp_path / "mods"
        mods.mkdir()
        module = mods / "ctl_reload_names.py"
        module.write_text(MODULE)
        paths = {"paths": [str(REPO), str(mods)]}
        async with running_daemon(tmp_path, ["ctl_reload_names"], workflows=paths) as d:
            module.write_text(MODULE + '\nraise ImportError("broken on purpose")\n')
            refused = await ctl("reload", socket=d.socket)
        assert refused.returncode == 1
        assert "cannot import 'ctl_reload_names': ImportError: broken" in refused.stdout.decode()


MODULE = """
from dataclasses import dataclass
from daemon import S, Section, Workflow

@dataclass
class Reloadable(Workflow):
    def definition(self) -> Section:
        return S()
"""


class TestTerminal:
    async def test_control_characters_are_escaped(self, tmp_path: Path) -> None:
        """ESC, BEL and CR from a client land escaped in people's output, exact in --json."""
        hostile = "x\x1b]0;owned\x07\r\x1b[2J"
        async with running_daemon(tmp_path, MODULES) as d:
            s = d.socket
            async with d.client() as c:
                await c.call("start", workflow="Vetting", workflow_id="v")
                await wait_status(c, "v", "Waiting")
                await c.call("send", workflow_id="v", event="note", input=hostile)
            by = json.dumps({"approve": True, "by": hostile})
            reply = ok(await ctl("send", "v", "decide", "--input", by, socket=s))
            assert reply == "approved by x\\x1b]0;owned\\x07\\r\\x1b[2J\n"
            async with d.client() as c:
                await wait_status(c, "v", "Finished")
            outputs = [
                ok(await ctl(*argv, socket=s))
                for argv in (["show", "v"], ["history", "v"], ["logs"], ["list"])
            ]
            raw = json.loads(ok(await ctl("show", "v", "--json", socket=s)))
            raw_reply = json.loads(ok(await ctl("--json", "wait", "v", socket=s)))
        for text in outputs:
            assert "\x1b" not in text and "\x07" not in text and "\r" not in text
        assert "\\u001b]0;owned\\u0007" in outputs[0]  # inside the data's JSON
        assert "\\x1b" in outputs[2] and "\\x07" in outputs[2]  # the log's plain fields
        assert raw["data"]["notes"] == [hostile]  # --json stays exact
        assert raw_reply["workflows"][0]["result"] == {"approved": True, "notes": 1}

    async def test_colours_on_a_terminal_only(self, tmp_path: Path) -> None:
        """Statuses are coloured on a pseudo-terminal, not through a pipe nor with NO_COLOR."""
        async with running_daemon(tmp_path, MODULES) as d:
            s = str(d.socket)
            ok(await ctl("start", "Latch", "--id", "l", socket=d.socket))
            env = clean_env(TERM="xterm")
            code, tty = await anyio.to_thread.run_sync(
                lambda: on_terminal("--socket", s, "list", env=env)
            )
            no_colour = clean_env(TERM="xterm", NO_COLOR="1")
            code2, plain = await anyio.to_thread.run_sync(
                lambda: on_terminal("--socket", s, "list", env=no_colour)
            )
            piped = ok(await ctl("list", socket=d.socket))
        assert code == 0 and b"\x1b[34mWaiting" in tty
        assert code2 == 0 and b"Waiting" in plain and b"\x1b[" not in plain
        assert "Waiting" in piped and "\x1b[" not in piped
