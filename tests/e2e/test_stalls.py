"""Nothing a client sends, and no code behind a request, leaves a caller or a step slot stuck."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from tests.helpers import REPO
from tests.helpers.client import Client
from tests.helpers.harness import running_daemon
from tests.helpers.wait import logged, shown_when, until, wait_status

MODULES = ["tests.workflows.stalls"]
#: How deeply request values may nest (README, "The control protocol").
MAX_NESTING = 64


async def answer(c: Client, line: str, limit_s: float = 10) -> dict[str, Any]:
    """Send one raw request line and return its response; no answer fails the test."""
    await c.stream.send(line.encode() + b"\n")
    with anyio.fail_after(limit_s):
        return await c.read()


def nested(depth: int) -> str:
    """Return a JSON list nested `depth` deep: `[[...]]`."""
    return "[" * depth + "]" * depth


class TestEveryRequestIsAnswered:
    """Any failure between taking a request and answering it answers with an error code."""

    async def test_deep_input_is_bad_input_at_every_depth(self, tmp_path: Path) -> None:
        """Input nested deeper than the limit is `bad_input`, up to the decoder's own limit.

        Past that the decoder refuses the line (`bad_request`); no depth goes unanswered.
        """
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            wid = (await c.call("start", workflow="Keeper"))["workflow_id"]
            await wait_status(c, wid, "Waiting")
            codes: dict[str, dict[int, str]] = {"send": {}, "start": {}, "edit": {}}
            depth = MAX_NESTING + 1
            while depth < 1100:
                v = nested(depth)
                lines = {
                    "send": f'{{"id": {depth}, "op": "send", "workflow_id": "{wid}",'
                    f' "event": "put", "input": {v}}}',
                    "start": f'{{"id": {depth}, "op": "start", "workflow": "Keeper",'
                    f' "input": {{"kept": {{"x": {v}}}}}}}',
                    "edit": f'{{"id": {depth}, "op": "edit", "workflow_id": "{wid}",'
                    f' "set": {{"kept": {{"x": {v}}}}}}}',
                }
                for op, line in lines.items():
                    response = await answer(c, line)
                    err = response.get("error") or {}
                    if err.get("code") == "bad_input":
                        assert response["id"] == depth, response
                    else:  # only the decoder itself may refuse, and only past its limit
                        assert err.get("code") == "bad_request", (op, depth, response)
                        assert "nested too deeply" in err["message"]
                    codes[op][depth] = err["code"]
                depth += 1 if 940 < depth < 1000 else 37
            # Right at the limit a value is taken as it is.
            at_limit = json.loads(nested(MAX_NESTING))
            assert await c.call("send", workflow_id=wid, event="put", input=at_limit) == "kept"
            shown = await wait_status(c, wid, "Finished")
        for op, by_depth in codes.items():
            accepted = [n for n, code in by_depth.items() if code == "bad_input"]
            refused = [n for n, code in by_depth.items() if code == "bad_request"]
            # The decoder refuses from some depth on, never below one it accepted.
            assert accepted and refused and max(accepted) < min(refused), (op, by_depth)
            assert max(accepted) > 900, (op, by_depth)
        assert shown["status"] == "Finished"
        assert shown["data"]["kept"]["value"] == json.loads(nested(MAX_NESTING))
        # No record explodes into a huge traceback.
        assert max(len(line) for line in d.output().splitlines()) < 20_000

    async def test_data_that_cannot_be_saved_is_refused(self, tmp_path: Path) -> None:
        """A handler that leaves data the store cannot write gets `bad_input`; nothing changes."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            wid = (await c.call("start", workflow="Keeper"))["workflow_id"]
            await wait_status(c, wid, "Waiting")
            response = await answer(
                c, json.dumps({"id": 1, "op": "send", "workflow_id": wid, "event": "tangle"})
            )
            assert response["error"]["code"] == "bad_input", response
            # The workflow waits on, unchanged, and takes the next event.
            assert await c.call("send", workflow_id=wid, event="put", input=1) == "kept"
            shown = await wait_status(c, wid, "Finished", "Waiting")
        assert shown["data"]["kept"] == {"value": 1}
        assert d.proc is not None and d.proc.returncode == 0

    async def test_code_that_raises_before_the_save_is_answered(self, tmp_path: Path) -> None:
        """An exception after the handler ran, before the save, answers `internal`."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            wid = (await c.call("start", workflow="Brittle"))["workflow_id"]
            await wait_status(c, wid, "Waiting")
            line = json.dumps({"id": 9, "op": "send", "workflow_id": wid, "event": "break_it"})
            response = await answer(c, line)
            assert response["id"] == 9 and response["error"]["code"] == "internal", response
            assert "broken by the data" in response["error"]["message"]
            # Nothing was saved: the workflow still waits, and its other thread still answers.
            assert await c.call("send", workflow_id=wid, event="poke") == "poked"
            shown = await c.call("show", workflow_id=wid)
        assert shown["data"]["broken"] is False


class TestCtlTimeout:
    """workflowctl gives up on a daemon that does not answer."""

    async def test_stopped_daemon_times_out_with_exit_3(self, tmp_path: Path) -> None:
        """With the daemon frozen (SIGSTOP), `--timeout 1` exits 3 after about a second."""
        async with running_daemon(tmp_path, MODULES) as d:
            assert d.proc is not None
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            argv = [sys.executable, "-m", "daemon.control.ctl", "--socket", str(d.socket)]
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                with anyio.fail_after(30):
                    done = await anyio.run_process(
                        [*argv, "--timeout", "1", "ping"], check=False, env=env
                    )
                took = time.monotonic() - began
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            with anyio.fail_after(30):
                alive = await anyio.run_process([*argv, "ping"], check=False, env=env)
        assert done.returncode == 3, done
        assert b"no answer within 1 s" in done.stderr
        assert 1 <= took < 15
        assert alive.returncode == 0, alive.stderr


class TestStepSlots:
    """A hung sync step gives its worker slot back at its timeout, and `show` tells who waits."""

    async def test_step_past_its_timeout_frees_its_slot(self, tmp_path: Path) -> None:
        """Two hung steps with a timeout, two slots: a third workflow's step still runs."""
        gate = tmp_path / "gate"
        runs = tmp_path / "runs"
        slots = {"max_concurrent_steps": 2}
        async with running_daemon(tmp_path, MODULES, runtime=slots) as d, d.client() as c:
            try:
                for n in range(2):
                    stuck = {"gate": str(gate), "runs": str(runs), "timeout": 0.5}
                    await c.call("start", workflow="Stuck", workflow_id=f"s{n}", input=stuck)
                await until(lambda: runs.exists() and len(runs.read_text().splitlines()) >= 2)
                await c.call("start", workflow="Quick", workflow_id="q")
                shown = await wait_status(c, "q", "Finished", limit_s=15)
                abandoned = await logged(d, "step_abandoned", 2, step="hold", reason="timeout")
                stuck_shown = await c.call("show", workflow_id="s0")
            finally:
                gate.touch()  # lets every abandoned thread end
            for n in range(2):
                await wait_status(c, f"s{n}", "Waiting")
            history = await c.call("history", workflow_id="s0")
        assert shown["data"]["ran"] is True
        assert all(r["abandoned_total"] >= 1 for r in abandoned)
        assert "timeout" in (stuck_shown["error"] or "")
        kinds = [h["kind"] for h in history]
        assert "step_abandoned" in kinds and "step_failed" in kinds

    async def test_show_tells_queued_from_running(self, tmp_path: Path) -> None:
        """With the only slot held, the next step shows `queued_since`; the holder `running_since`."""
        gate = tmp_path / "gate"
        slots = {"max_concurrent_steps": 1}
        async with running_daemon(tmp_path, MODULES, runtime=slots) as d, d.client() as c:
            try:
                began = time.time()
                await c.call("start", workflow="Stuck", workflow_id="s", input={"gate": str(gate)})
                holder = await shown_when(c, "s", lambda s: "running_step" in s)
                await c.call("start", workflow="Quick", workflow_id="q")
                starved = await shown_when(c, "q", lambda s: "running_step" in s)
                holder = await c.call("show", workflow_id="s")
            finally:
                gate.touch()
            await wait_status(c, "q", "Finished")
        held, waiting = holder["running_step"], starved["running_step"]
        assert held["step"] == "hold" and "queued_since" not in held
        assert began - 1 <= held["running_since"] <= time.time() and held["for_s"] >= 0
        assert waiting["step"] == "quick" and "running_since" not in waiting
        assert held["running_since"] <= waiting["queued_since"] <= time.time()
        assert waiting["for_s"] >= 0
