"""workflowctl's text for people: escaping, times, colours and the `show` description."""

from __future__ import annotations

import json
from datetime import datetime

from daemon.control.render import (
    Style,
    cell,
    describe,
    escape,
    local_time,
    log_text,
    relative,
    span,
    table,
    wait_result,
)

NOW = 1_800_000_000.0


class TestEscape:
    def test_control_characters(self) -> None:
        """ESC, BEL, CR, DEL and C1 controls are shown as escapes; text and newlines stay."""
        assert escape("a\x1b[2Jb\x07c\rd\x7fe\x9bf") == "a\\x1b[2Jb\\x07c\\rd\\x7fe\\x9bf"
        assert escape("two\nlines\tok") == "two\nlines\tok"
        assert escape("two\nlines", lines=False) == "two\\nlines"
        assert escape("ünïcode ✓") == "ünïcode ✓"

    def test_every_cell_and_log_field(self) -> None:
        """Table cells and log fields never carry a control character."""
        assert cell("x\x1b]0;t\x07") == "x\\x1b]0;t\\x07"
        line = log_text({"event": "e\x1b", "level": "info", "k\x07": "v\r"})
        assert "\x1b" not in line and "\x07" not in line and "\r" not in line


class TestTimes:
    def test_local_time_with_offset(self) -> None:
        """Times are local, with their UTC offset; durations read as people say them."""
        expected = datetime.fromtimestamp(NOW).astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
        assert local_time(NOW) == expected
        assert (span(4), span(59 * 60), span(3 * 3600), span(2 * 86400)) == (
            "4 s",
            "59 min",
            "3 h",
            "2 d",
        )
        assert relative(NOW - 180, NOW) == "3 min ago" and relative(NOW + 4, NOW) == "in 4 s"


class TestColours:
    def test_status_column_only_when_on(self) -> None:
        """Statuses get their colour when on; columns still line up; nothing when off."""
        rows = [{"status": "Failed", "n": 1}, {"status": "Waiting", "n": 22}]
        on = table(rows, ["status", "n"], Style(True)).splitlines()
        off = table(rows, ["status", "n"], Style(False)).splitlines()
        assert on[1] == "\x1b[31mFailed \x1b[0m  1" and on[2] == "\x1b[34mWaiting\x1b[0m  22"
        assert off == ["STATUS   N", "Failed   1", "Waiting  22"]


SHOWN = {
    "workflow_id": "w",
    "workflow": "Vetting",
    "status": "Resuming",
    "created_at": NOW - 180,
    "updated_at": NOW - 4,
    "error": "step 'x' failed: E",
    "next_run_at": NOW + 4,
    "retry": {"step": "x", "attempt": 3, "max_attempts": 6},
    "running_step": {"step": "y", "for_s": 12.5, "running_since": NOW - 12.5},
    "data": {"a": [1], "s": "t\x1b"},
    "state": {
        "threads": [
            {"id": "_main_", "status": "Executing", "cur_step": "x", "wait_events": []},
            {
                "id": "side",
                "status": "WaitingEvent",
                "cur_step": "w8",
                "wait_events": [
                    {
                        "type": "timer",
                        "status": "Setup",
                        "req": {"name": "tick", "setup_data": json.dumps({"deadline": NOW + 3540})},
                    },
                    {
                        "type": "signal",
                        "status": "SetupError",
                        "error": "boom",
                        "req": {"name": "go", "setup_data": ""},
                    },
                ],
            },
        ]
    },
}


class TestDescribe:
    def test_show(self) -> None:
        """show says status, times, threads, waits, the step, the retry, the error and the data."""
        text = describe(SHOWN, now=NOW)
        at = datetime.fromtimestamp(NOW + 3540).astimezone().strftime("%H:%M:%S")
        assert text.splitlines()[:3] == [
            "w  Vetting  Resuming",
            f"created  {local_time(NOW - 180)}  (3 min ago)",
            f"updated  {local_time(NOW - 4)}  (4 s ago)",
        ]
        assert "  _main_  runs step x" in text and "  side    waits at w8" in text
        assert f"tick: timer fires in 59 min, at {at}" in text
        assert "go: `workflowctl send w go`; setup failed, retried: boom" in text
        assert "step     y: running for 12 s" in text
        assert "retry    step x: attempt 3 of 6, next in 4 s" in text
        assert "error    step 'x' failed: E" in text
        assert '    "s": "t\\u001b"' in text.splitlines()
        assert "1800000" not in text

    def test_wait_result(self) -> None:
        """Each ended workflow gets its status, error and result; a pending one says so."""
        result = {
            "timed_out": True,
            "workflows": [
                {"workflow_id": "a", "status": "Failed", "ended": True, "error": "e", "result": 1},
                {"workflow_id": "b", "status": "Waiting", "ended": False},
            ],
        }
        assert wait_result(result).splitlines() == [
            "a: Failed",
            "  error: e",
            "  1",
            "b: Waiting (not ended)",
        ]
