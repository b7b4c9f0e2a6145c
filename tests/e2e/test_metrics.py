"""`/metrics` of a real daemon, parsed by Prometheus's own text parser, against a known run."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.harness import run_workflowd, running_daemon, write_config
from tests.helpers.http import fetch, free_port
from tests.helpers.wait import eventually, settled, wait_status

MODULES = ["tests.workflows.observe"]


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Map (sample name, labels) to value for every sample of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """Return one sample's value (0 if absent)."""
    return found.get((name, frozenset(labels.items())), 0.0)


async def test_metrics_count_a_known_run(short_tmp: Path) -> None:
    """Steps, callbacks, workflows by status, waits, timers, commits, inbox, fires, version."""
    address = str(short_tmp / "metrics.sock")
    async with (
        running_daemon(short_tmp, MODULES, metrics={"listen": address}) as d,
        d.client() as c,
    ):
        for wid in ("c1", "c2"):
            await c.call("start", workflow="Counted", workflow_id=wid)
            await wait_status(c, wid, "Waiting")
            await c.call("send", workflow_id=wid, event="go")
            await wait_status(c, wid, "Finished")
        await c.call("start", workflow="Doomed", workflow_id="d1")
        await wait_status(c, "d1", "Failed")
        await c.call("start", workflow="Gatekeeper", workflow_id="g1")
        await wait_status(c, "g1", "Waiting")
        rejected = await c.request("send", workflow_id="g1", event="nope")
        assert not rejected["ok"]
        await c.call("start", workflow="Ticker", workflow_id="t1")
        await wait_status(c, "t1", "Finished")
        await settled(c)

        found: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}

        async def scraped() -> bool:
            nonlocal found
            reply = await fetch(address, "/metrics")
            assert reply.status == 200
            assert reply.headers["content-type"].startswith("text/plain")
            found = samples(reply.body.decode())
            return (
                value(found, "workflowd_schedule_fires_total", schedule="blip", outcome="fired")
                >= 1
            )

        await eventually(scraped)
        for step in "abc":
            steps = value(
                found, "workflowd_steps_total", workflow="Counted", step=step, outcome="done"
            )
            assert steps == 2
        assert (
            value(found, "workflowd_steps_total", workflow="Doomed", step="boom", outcome="failed")
            == 1
        )
        assert value(found, "workflowd_step_duration_seconds_count", workflow="Counted") == 6
        assert (
            value(found, "workflowd_step_duration_seconds_bucket", workflow="Counted", le="+Inf")
            == 6
        )
        assert value(found, "workflowd_workflows", workflow="Counted", status="Finished") == 2
        assert value(found, "workflowd_workflows", workflow="Doomed", status="Failed") == 1
        assert value(found, "workflowd_workflows", workflow="Gatekeeper", status="Waiting") == 1
        assert value(found, "workflowd_callbacks_total", outcome="applied") == 3  # 2 go, 1 tick
        assert value(found, "workflowd_callbacks_total", outcome="rejected") == 1
        assert value(found, "workflowd_waits_armed", kind="timer") == 1  # Gate's far timer
        assert value(found, "workflowd_timer_lateness_seconds_count") == 1
        commits = value(found, "workflowd_commit_duration_seconds_count")
        assert commits >= 10
        assert value(found, "workflowd_commit_batch_size_count") == commits
        assert value(found, "workflowd_commit_batch_size_sum") >= commits
        assert value(found, "workflowd_inbox_depth") == 0
        assert value(found, "workflowd_build_info", version="0.1.0") == 1
        om = await fetch(address, "/metrics", headers={"Accept": "application/openmetrics-text"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        # The library leaves the OpenMetrics parser without annotations.
        families = openmetrics_families(om.body.decode())  # type: ignore[no-untyped-call]
        parsed = {f.name for f in families}
        assert {"workflowd_steps", "workflowd_workflows", "workflowd_build_info"} <= parsed
        assert (await fetch(address, "/nope")).status == 404
        assert (await fetch(address, "/metrics", method="POST")).status == 405


async def test_metrics_over_tcp_and_off_by_default(short_tmp: Path) -> None:
    """ "host:port" serves the same text; without [metrics] nothing listens."""
    address = f"127.0.0.1:{free_port()}"
    async with running_daemon(short_tmp, MODULES, metrics={"listen": address}):
        reply = await fetch(address, "/metrics")
        assert reply.status == 200
        assert b"workflowd_build_info" in reply.body
    (short_tmp / "daemon.log").unlink()
    async with running_daemon(short_tmp, MODULES) as d:
        assert not [r for r in d.records() if r.get("event") == "http_listening"]
        with pytest.raises(OSError):
            await fetch(address, "/metrics")


@pytest.mark.parametrize(
    ("listen", "message"),
    [("nowhere", "host:port"), ("127.0.0.1:99999", "host:port")],
)
async def test_bad_listen_address_stops_the_start(
    short_tmp: Path, listen: str, message: str
) -> None:
    """A malformed address is a config error: exit 2, one line naming the key."""
    config = write_config(short_tmp, MODULES, metrics={"listen": listen})
    code, err = await run_workflowd(config)
    assert code == 2
    assert "[metrics] listen" in err
    assert message in err


async def test_taken_port_stops_the_start(short_tmp: Path) -> None:
    """An address that cannot be bound stops the start (exit 2, naming it) before READY."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = f"127.0.0.1:{s.getsockname()[1]}"
        config = write_config(short_tmp, MODULES, metrics={"listen": taken})
        code, err = await run_workflowd(config)
    assert code == 2, err
    assert f"cannot listen on {taken}" in err
