"""Go threads of one workflow run their steps at the same time, in a real `workflowd`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness import Daemon, running_daemon, write_config
from tests.helpers.wait import eventually, logged, shown_when, until, wait_status

MODULES = ["tests.workflows.fanout"]


def overlapped(spans: dict[str, list[float]]) -> bool:
    """Tell whether every step was running at one moment: the last to begin began first."""
    return max(b for b, _ in spans.values()) < min(e for _, e in spans.values())


def step_log(tmp: Path) -> list[str]:
    """Return the lines the fixture steps appended to $E2E_STEP_LOG."""
    path = tmp / "steps.log"
    return path.read_text().split() if path.exists() else []


class TestFanOut:
    """Steps of different threads overlap; their data changes all land."""

    @pytest.mark.parametrize(("n", "use_async"), [(2, False), (8, False), (8, True)])
    async def test_threads_run_at_once(self, tmp_path: Path, n: int, use_async: bool) -> None:
        """`n` one-second steps in `n` Go threads overlap and all their appends land."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            input = {"n": n, "sleep_s": 1.0, "use_async": use_async}
            await c.call("start", workflow="FanOut", workflow_id="f", input=input)
            shown = await wait_status(c, "f", "Finished", "Failed")
        data = shown["data"]
        assert shown["status"] == "Finished", shown["error"]
        assert sorted(data["items"]) == sorted(f"w{k}" for k in range(n))
        assert sorted(data["spans"]) == sorted(f"w{k}" for k in range(n))
        # Run one after the other, the last would begin n - 1 seconds after the first ended.
        assert overlapped(data["spans"]), data["spans"]
        ends = [e for _, e in data["spans"].values()]
        begins = [b for b, _ in data["spans"].values()]
        assert max(ends) - min(begins) < 1.0 * n - 0.5
        # The appends land in completion order, each thread's name once.
        order = sorted(data["spans"], key=lambda k: data["spans"][k][1])
        assert data["items"] == order

    async def test_own_fields_and_a_conflict(self, tmp_path: Path) -> None:
        """Fields written by one thread each take its value; a scalar two threads changed
        takes the later completion's, and the conflict is logged with the field name."""
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="OwnFields", workflow_id="o")
            shown = await wait_status(c, "o", "Finished", "Failed")
            (conflict,) = await logged(d, "step_merge_conflict")
            history = await c.call("history", workflow_id="o")
        data = shown["data"]
        assert shown["status"] == "Finished", shown["error"]
        assert overlapped(data["spans"]), data["spans"]
        assert (data["left"], data["right"], data["winner"]) == ("L", "R", "late")
        assert conflict["field"] == "winner" and conflict["step"] == "late"
        assert conflict["workflow_id"] == "o"
        kinds = [h["kind"] for h in history]
        assert kinds.count("step_merge_conflict") == 1 and kinds.count("step_done") == 4


class TestFailures:
    """Retries stay in their thread; a failure for good stops the others."""

    async def test_retry_does_not_stop_other_threads(self, tmp_path: Path) -> None:
        """A step failing twice is retried while another thread's step runs on, once."""
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        async with running_daemon(tmp_path, MODULES, env=env) as d, d.client() as c:
            await c.call("start", workflow="Retried", workflow_id="r")
            shown = await wait_status(c, "r", "Finished", "Failed")
            failures = await logged(d, "step_failed", count=2)
        assert shown["status"] == "Finished", shown["error"]
        runs = step_log(tmp_path)
        assert runs.count("flaky") == 3 and runs.count("steady") == 1
        spans = shown["data"]["spans"]
        # The flaky step's three attempts all happened while the steady step was running.
        assert spans["steady"][0] < spans["flaky"][1] < spans["steady"][1]
        # A failed attempt's changes are discarded; the successful one's land.
        assert sorted(shown["data"]["notes"]) == ["flaky tried", "steady"]
        assert {f["step"] for f in failures} == {"flaky"}
        assert all("retry_in_s" in f for f in failures)

    async def test_failure_for_good_cancels_other_threads(self, tmp_path: Path) -> None:
        """A step that fails for good fails the workflow at once: the other threads' async
        step is cancelled and their sync step abandoned, and none of their changes land."""
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        async with running_daemon(tmp_path, MODULES, env=env) as d, d.client() as c:
            await c.call("start", workflow="OneFails", workflow_id="x")
            shown = await wait_status(c, "x", "Failed", "Finished", limit_s=10)
            (abandoned,) = await logged(d, "step_abandoned")
            assert "sync_ended" not in step_log(tmp_path)  # failed before the 3 s step ended
        assert "cannot go on" in shown["error"]
        assert shown["data"]["notes"] == [] and shown["running"] == []
        assert abandoned["step"] == "long_sync" and abandoned["reason"] == "cancelled"
        assert "async_began" in step_log(tmp_path) and "async_ended" not in step_log(tmp_path)


class TestSeeingAndStopping:
    """`show`, `list`, cancel, shutdown, repairs and crashes with several steps in flight."""

    @staticmethod
    async def all_slow_running(c: Any) -> dict[str, Any]:
        """Wait until the three slow steps run, as `show` tells it; return that `show`."""

        def three(s: dict[str, Any]) -> bool:
            threads = {t["id"]: t for t in s["state"]["threads"]}
            return len(s.get("running", [])) == 3 and all(
                threads.get(f"g{k}", {}).get("cur_step") == f"slow{k}" for k in range(3)
            )

        return await shown_when(c, "g", three)

    async def test_show_and_list_tell_what_runs(self, tmp_path: Path) -> None:
        """While three steps run, `show` lists each with its thread and start, the stored
        threads say Executing at their step, and `list` rows name the steps."""
        gate = tmp_path / "gate"
        async with running_daemon(tmp_path, MODULES) as d, d.client() as c:
            await c.call("start", workflow="GatedFan", workflow_id="g", input={"gate": str(gate)})
            shown = await self.all_slow_running(c)
            (row,) = await c.call("list")
            assert sorted(row["running"]) == ["slow0", "slow1", "slow2"]
            gate.touch()
            done = await wait_status(c, "g", "Finished")
            (row,) = await c.call("list")
        running = sorted(shown["running"], key=lambda r: r["thread_id"])
        assert [(r["thread_id"], r["step"]) for r in running] == [
            (f"g{k}", f"slow{k}") for k in range(3)
        ]
        assert all(isinstance(r["since"], float) and r["since"] > 1e9 for r in running)
        threads = {t["id"]: t for t in shown["state"]["threads"]}
        assert all(threads[f"g{k}"]["status"] == "Executing" for k in range(3))
        assert sorted(done["data"]["slow"]) == ["s0", "s1", "s2"]
        assert done["running"] == [] and row["running"] == []

    async def test_sigkill_while_three_steps_run(self, tmp_path: Path) -> None:
        """Killed while three steps run, the daemon runs each of them again after the
        restart, and none of the steps whose completion was checkpointed."""
        gate = tmp_path / "gate"
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        d = Daemon(tmp_path, write_config(tmp_path, MODULES), env)
        await d.start()
        try:
            async with d.client() as c:
                await c.call(
                    "start", workflow="GatedFan", workflow_id="g", input={"gate": str(gate)}
                )
                await self.all_slow_running(c)
            # `running` lists a sync step still queued for a worker thread too: wait until
            # each of the three has begun.
            await until(lambda: sum(x.startswith("slow") for x in step_log(tmp_path)) == 3)
            await d.kill()
            await d.start()
            async with d.client() as c:
                await until(lambda: sum(x.startswith("slow") for x in step_log(tmp_path)) == 6)
                gate.touch()
                shown = await wait_status(c, "g", "Finished")
        finally:
            await d.stop()
        runs = step_log(tmp_path)
        assert sorted(x for x in runs if x.startswith("quick")) == ["quick0", "quick1", "quick2"]
        assert sorted(x for x in runs if x.startswith("slow")) == sorted(
            [f"slow{k}" for k in range(3)] * 2
        )
        assert sorted(shown["data"]["quick"]) == ["q0", "q1", "q2"]
        assert sorted(shown["data"]["slow"]) == ["s0", "s1", "s2"]

    async def test_cancel_goto_edit_and_shutdown(self, tmp_path: Path) -> None:
        """With three steps in flight, goto and edit answer `conflict`, a graceful stop lets
        them finish (their completions stored), and cancel ends the workflow at once."""
        gate = tmp_path / "gate"
        env = {"E2E_STEP_LOG": str(tmp_path / "steps.log")}
        config = write_config(tmp_path, MODULES, daemon={"shutdown_grace_s": 20.0})
        d = Daemon(tmp_path, config, env)
        await d.start()
        try:
            async with d.client() as c:
                await c.call(
                    "start", workflow="GatedFan", workflow_id="g", input={"gate": str(gate)}
                )
                await self.all_slow_running(c)
                repairs: list[tuple[str, dict[str, Any]]] = [
                    ("goto", {"thread_id": "g0", "statement": "quick0"}),
                    ("edit", {"set": {"quick": []}}),
                ]
                for op, fields in repairs:
                    response = await c.request(op, workflow_id="g", **fields)
                    assert not response["ok"] and response["error"]["code"] == "conflict"
            stopping = d.proc
            assert stopping is not None
            stopping.send_signal(15)
            (stopped,) = await logged(d, "daemon_stopping")
            gate.touch()  # the three steps may end now; the daemon waits for them
            await until(lambda: stopping.poll() is not None, limit_s=30)
            assert stopping.returncode == 0
            (stopped,) = await logged(d, "daemon_stopped")
            assert stopped["steps_finished"] is True
            gate.unlink()
            await d.start()
            async with d.client() as c:
                shown = await wait_status(c, "g", "Finished")
                assert sorted(shown["data"]["slow"]) == ["s0", "s1", "s2"]
                slow = [x for x in step_log(tmp_path) if x.startswith("slow")]
                assert len(slow) == 3  # the graceful stop let them finish: none ran again
                # Cancel with steps in flight: a new run, held at its gate.
                await c.call(
                    "start", workflow="GatedFan", workflow_id="h", input={"gate": str(gate)}
                )

                async def three() -> bool:
                    s = await c.call("show", workflow_id="h")
                    return len(s["running"]) == 3

                await eventually(three, limit_s=20)
                cancelled = await c.call("cancel", workflow_id="h")
                assert cancelled["status"] == "Cancelled"
                shown = await c.call("show", workflow_id="h")
                assert shown["status"] == "Cancelled" and shown["running"] == []
        finally:
            await d.stop()
