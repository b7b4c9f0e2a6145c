"""Tests for daemon.service.logwriter: what the writer thread renders off the loop."""

from __future__ import annotations

import contextvars
import datetime
import enum
import io
import json
import sys
from pathlib import Path

import pytest
import structlog

from daemon.service import log as log_module
from daemon.service.logwriter import Record, iso_time, stamped


class TestIsoTime:
    @pytest.mark.parametrize(
        "stamp",
        [1764607292.0, 1764607292.999999, 1764607292.9999999, 1764607292.000001, 0.25, 1e9 + 5e-7],
    )
    def test_timestamp_as_timestamper_writes_it(self, stamp: float) -> None:
        """The writer renders the call's time as TimeStamper(fmt="iso", utc=True) would."""
        when = datetime.datetime.fromtimestamp(stamp, datetime.UTC)
        assert iso_time(stamp) == when.isoformat().replace("+00:00", "Z")

    def test_a_batch_is_stamped_as_timestamper_writes_each(self) -> None:
        """The batch pass renders each record's time as iso_time does, across seconds."""
        stamps = [1764607292.0, 1764607292.9999999, 1764607293.5, 0.25, 1764607292.000001, 5.0]
        context = contextvars.copy_context()
        batch: list[Record] = [("warn", {"event": "e"}, context, s) for s in stamps]
        dicts = stamped(batch, {"warn": "warning"})
        want = [
            datetime.datetime.fromtimestamp(s, datetime.UTC).isoformat().replace("+00:00", "Z")
            for s in stamps
        ]
        assert [d["timestamp"] for d in dicts] == want
        assert {d["level"] for d in dicts} == {"warning"}


class Shade(enum.Enum):
    DARK = "dark"


class Unprintable:
    """A value that neither msgspec nor str() can render."""

    def __str__(self) -> str:
        raise RuntimeError("no text for this")


def _records(stamp: float) -> list[Record]:
    """Records as _Leveled queues them: warn/exception names, odd values, a traceback."""
    bound = structlog.contextvars.bind_contextvars
    with structlog.contextvars.bound_contextvars(workflow_id="w1", step="ctx"):
        plain = contextvars.copy_context()
    token = bound(workflow="A")["workflow"]
    structlog.contextvars.unbind_contextvars("workflow")  # bound once, now Ellipsis: skipped
    unbound = contextvars.copy_context()
    token.var.reset(token)
    try:
        raise ValueError("bad")
    except ValueError:
        failed = sys.exc_info()
    return [
        ("info", {"step": "a", "duration_ms": 0.5, "event": "step_done"}, plain, stamp),
        ("warn", {"path": Path("/x"), "tags": (1, 2), "event": "odd"}, unbound, stamp + 0.25),
        ("exception", {"exc_info": failed, "event": "step_failed"}, plain, stamp + 1.0),
        ("info", {"shade": Shade.DARK, "_meta": 1, "event": "enum"}, plain, stamp + 2.0),
    ]


def _chain(record: Record) -> bytes:
    """Render one record through structlog's own processors, as the unfused chain did."""
    method, event_dict, context, stamp = record
    event_dict = context.run(structlog.contextvars.merge_contextvars, None, method, event_dict)
    event_dict["timestamp"] = iso_time(stamp)
    event_dict = structlog.processors.add_log_level(None, method, event_dict)
    event_dict = structlog.processors.dict_tracebacks(None, method, event_dict)
    return log_module._render_json(None, method, event_dict).encode() + b"\n"


class TestFusedChain:
    def test_lines_are_those_of_the_processor_chain_byte_for_byte(self) -> None:
        """One batch through the fused emitter writes exactly what the processors wrote."""
        out = io.StringIO()
        hub = log_module.LogHub()
        records = _records(1764607292.123456)
        # The same records for both (a traceback shows its frames' locals), copied: both
        # render into the event dict.
        expected = b"".join(_chain((m, dict(e), c, s)) for m, e, c, s in records)
        log_module._json_emitter(out, hub, None)(records)
        assert out.getvalue().encode() == expected
        # The hub's readers get the same records, made JSON-able.
        got = hub.recent()
        assert [r["event"] for r in got] == ["step_done", "odd", "step_failed", "enum"]
        assert got[1]["path"] == "/x" and got[1]["level"] == "warning"
        assert got[2]["exception"][0]["exc_type"] == "ValueError"
        assert got[3]["shade"] == "Shade.DARK" and "_meta" not in got[3]  # as the hub had them
        json.dumps(got)

    def test_a_value_that_cannot_become_text_costs_only_itself(self) -> None:
        """A value whose str() raises is shown as a placeholder; its batch is written whole."""
        out = io.StringIO()
        hub = log_module.LogHub()
        stamp = 1764607292.5
        context = contextvars.copy_context()
        batch: list[Record] = [
            ("info", {"event": "before"}, context, stamp),
            ("info", {"event": "broken", "value": Unprintable()}, context, stamp),
            ("info", {"event": "odd", "value": Shade.DARK, "bag": {1}}, context, stamp),
            ("info", {"event": "after"}, context, stamp),
        ]
        log_module._json_emitter(out, hub, None)(batch)
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [r["event"] for r in lines] == ["before", "broken", "odd", "after"]
        assert lines[1]["value"] == "<Unprintable: str() failed>"
        assert lines[2]["value"] == "dark" and lines[2]["bag"] == [1]  # as msgspec renders them
        assert hub.recent()[1]["value"] == "<Unprintable: str() failed>"  # readers do not break
