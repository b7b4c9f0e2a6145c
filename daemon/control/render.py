"""workflowctl's output for people: tables, descriptions, local times, colours, safe text.

Whatever the daemon sends may hold control characters (any client can put them into ids,
replies and log fields); every string shown here goes through `escape`, so none reaches the
terminal. `--json` output does not come through here.
"""

from __future__ import annotations

import contextlib
import re
import time
from datetime import datetime
from typing import Any

import msgspec

#: C0 controls (but newline and tab), DEL and C1 controls: a terminal acts on these.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_ALL = re.compile("[\x00-\x1f\x7f-\x9f]")
#: SGR colour of each status; the others stay plain.
COLOURS = {"Failed": "31", "Finished": "32", "Waiting": "34", "Cancelled": "33"}
_encoder = msgspec.json.Encoder(enc_hook=str)


def escape(text: str, *, lines: bool = True) -> str:
    """Show control characters as `\\x1b` escapes; with `lines=False`, newlines and tabs too."""
    pattern = _CONTROL if lines else _CONTROL_ALL
    return pattern.sub(_escaped, text)


_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or f"\\x{ord(c):02x}"


class Style:
    """Colours statuses when on (a terminal, and no NO_COLOR); plain text when off."""

    def __init__(self, colour: bool) -> None:
        self.colour = colour

    def status(self, text: str, status: str | None = None) -> str:
        """Return `text` in the colour of `status` (default: the text itself)."""
        code = COLOURS.get(status or text.strip())
        if not self.colour or code is None:
            return text
        return f"\x1b[{code}m{text}\x1b[0m"


PLAIN = Style(False)


def compact(value: Any) -> str:
    """Return one-line JSON (control characters come out as JSON escapes)."""
    return _encoder.encode(value).decode()


def pretty(value: Any) -> str:
    """Return indented JSON."""
    return msgspec.json.format(_encoder.encode(value), indent=2).decode()


def local_time(ts: float) -> str:
    """Return Unix seconds as local time with its offset: `2026-12-01 14:02:03 +0100`."""
    return datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S %z")


def span(seconds: float) -> str:
    """Return a duration the way people say it: `4 s`, `59 min`, `3 h`, `2 d`."""
    s = abs(seconds)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    if s < 86400:
        return f"{s / 3600:.0f} h"
    return f"{s / 86400:.0f} d"


def relative(ts: float, now: float | None = None) -> str:
    """Return `3 min ago` or `in 59 min`."""
    delta = ts - (time.time() if now is None else now)
    return f"in {span(delta)}" if delta > 0 else f"{span(delta)} ago"


def is_time(column: str) -> bool:
    """Tell whether a column holds Unix seconds (`at`, `*_at`, `timestamp`)."""
    return column in ("at", "timestamp") or column.endswith("_at")


def cell(value: Any, column: str = "") -> str:
    """Return a value as one table cell: one line, times in local time, no control characters."""
    if value is None:
        return ""
    if is_time(column) and isinstance(value, int | float) and not isinstance(value, bool):
        return local_time(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return escape(", ".join(value), lines=False)
    text = value if isinstance(value, str) else compact(value)
    return escape(text, lines=False)


def table(
    rows: list[dict[str, Any]], columns: list[str], style: Style = PLAIN, status: str = "status"
) -> str:
    """Return rows as an aligned text table with a header; the `status` column is coloured."""
    grid = [[c.upper() for c in columns]] + [[cell(r.get(c), c) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(columns))]
    out = []
    for n, line in enumerate(grid):
        cells = [v.ljust(w) for v, w in zip(line, widths, strict=True)]
        if n and status in columns:
            i = columns.index(status)
            cells[i] = style.status(cells[i], line[i])
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def log_text(record: dict[str, Any]) -> str:
    """Return a log record as one line: local time, level, event, then key=value."""
    rest = {k: v for k, v in record.items() if k not in ("timestamp", "level", "event")}
    stamp = record.get("timestamp", "")
    if isinstance(stamp, str) and stamp:
        with contextlib.suppress(ValueError):  # not ISO 8601: shown as sent
            stamp = local_time(datetime.fromisoformat(stamp).timestamp())
    head = f"{cell(stamp)} {cell(record.get('level', '')):<7} {cell(record.get('event', ''))}"
    return " ".join([head.strip(), *(f"{cell(k)}={cell(v)}" for k, v in rest.items())])


# -- show ---------------------------------------------------------------------------------------


def _setup(ev: dict[str, Any]) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(ev.get("req", {}).get("setup_data") or "{}")
    except msgspec.DecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def wait_text(ev: dict[str, Any], workflow_id: str, now: float) -> str:
    """Say what one armed wait case waits for, and when a timer fires."""
    name = cell(ev.get("req", {}).get("name"))
    kind, setup = ev.get("type"), _setup(ev)
    deadline = setup.get("deadline")
    if kind == "timer" and isinstance(deadline, int | float):
        at = datetime.fromtimestamp(deadline).astimezone()
        today = datetime.fromtimestamp(now).astimezone().date()
        day = "" if at.date() == today else f"{at:%Y-%m-%d} "
        what = f"timer fires {relative(deadline, now)}, at {day}{at:%H:%M:%S}"
        if deadline <= now:
            what = f"timer due since {span(now - deadline)} (at {day}{at:%H:%M:%S})"
    elif kind == "file_watch" or "on" in setup:
        what = f"file {cell(setup.get('path'))} {cell(setup.get('on'))}"
    elif kind == "socket" or "port" in setup or "path" in setup:
        where = setup.get("path") or f"{setup.get('host') or '*'}:{setup.get('port')}"
        what = f"a message on socket {cell(where)}"
    elif kind == "signal":
        what = f"`workflowctl send {cell(workflow_id)} {name}`"
    else:
        what = f"a {cell(kind)} event"
    status = ev.get("status")
    if status == "SetupError":
        what += f"; setup failed, retried: {cell(ev.get('error'))}"
    elif status == "PendingSetup":
        what += " (being set up)"
    return f"{name}: {what}"


def thread_text(t: dict[str, Any]) -> str:
    """Say where a thread stands."""
    at, status = cell(t.get("cur_step")), t.get("status")
    if status == "WaitingEvent":
        return f"waits at {at}"
    if status == "WaitingCondition":
        return f"waits until the condition of {at} holds"
    if status == "Executing":
        return f"runs step {at}"
    return f"resuming after {at}" if at else "resuming"


def describe(result: dict[str, Any], style: Style = PLAIN, now: float | None = None) -> str:
    """Return `show` for people: status, times, threads and waits, retry state, error, data."""
    now = time.time() if now is None else now
    wid = cell(result.get("workflow_id"))
    status = cell(result.get("status"))
    lines = [f"{wid}  {cell(result.get('workflow'))}  {style.status(status)}"]

    def when(label: str, ts: Any) -> None:
        if isinstance(ts, int | float):
            lines.append(f"{label:<9}{local_time(ts)}  ({relative(ts, now)})")

    when("created", result.get("created_at"))
    when("updated", result.get("updated_at"))
    if result.get("held"):
        lines.append(f"held     yes: `workflowctl resume {wid}` lets it run")
    if result.get("incompatible"):
        lines.append(f"held     it does not fit the running code: {cell(result['incompatible'])}")
    state = result.get("state")
    threads = state.get("threads", []) if isinstance(state, dict) else []
    if threads:
        lines.append("threads")
        width = max(len(cell(t.get("id"))) for t in threads)
        for t in threads:
            lines.append(f"  {cell(t.get('id')):<{width}}  {thread_text(t)}")
            for ev in t.get("wait_events", []):
                if ev.get("status") in ("Setup", "PendingSetup", "SetupError"):
                    lines.append(f"  {'':<{width}}    {wait_text(ev, wid, now)}")
    running = result.get("running_step")
    if isinstance(running, dict):
        how = "waits for a worker slot" if "queued_since" in running else "running"
        since = running.get("for_s")
        took = f" for {span(since)}" if isinstance(since, int | float) else ""
        lines.append(f"step     {cell(running.get('step'))}: {how}{took}")
    in_flight = result.get("running")
    if isinstance(in_flight, list) and len(in_flight) > 1:  # Go threads' steps at once
        for run in in_flight[1:]:
            if isinstance(run, dict):
                lines.append(
                    f"step     {cell(run.get('step'))} (thread {cell(run.get('thread_id'))})"
                )
    retry = result.get("retry")
    if isinstance(retry, dict):
        limit = retry.get("max_attempts")
        of = f" of {limit}" if limit else ""
        text = f"attempt {retry.get('attempt')}{of}"
        nxt = result.get("next_run_at")
        if isinstance(nxt, int | float):
            text += f", next {relative(nxt, now)}" if nxt > now else ", next now"
        step = f"step {cell(retry.get('step'))}: " if retry.get("step") else ""
        lines.append(f"retry    {step}{text}")
    if result.get("error"):
        lines.append(f"error    {cell(result['error'])}")
    lines.append("data")
    data = pretty(result.get("data"))
    lines += [f"  {line}" for line in escape(data).splitlines()]
    return "\n".join(lines)


def wait_result(result: dict[str, Any], style: Style = PLAIN, *, any: bool = False) -> str:
    """Return each waited-for workflow's end: `ID: STATUS`, then its result as indented JSON."""
    lines = []
    for w in result.get("workflows", []):
        wid, status = cell(w.get("workflow_id")), cell(w.get("status"))
        if not w.get("ended"):
            if not any or result.get("timed_out"):
                lines.append(f"{wid}: {style.status(status)} (not ended)")
            continue
        lines.append(f"{wid}: {style.status(status)}")
        if w.get("error"):
            lines.append(f"  error: {cell(w['error'])}")
        if w.get("result_error"):
            lines.append(f"  result() failed: {cell(w['result_error'])}")
        if w.get("result") is not None:
            lines += [f"  {line}" for line in escape(pretty(w["result"])).splitlines()]
    return "\n".join(lines)


def types_text(rows: list[dict[str, Any]]) -> str:
    """Return the workflow types, each with its input fields and defaults."""
    lines = []
    for r in rows:
        doc = f"  {cell(r.get('doc'))}" if r.get("doc") else ""
        lines.append(f"{cell(r.get('workflow'))}{doc}")
        for f in r.get("fields", []):
            default = "required" if f.get("required") else f"= {compact(f.get('default'))}"
            lines.append(f"  {cell(f.get('name'))}: {cell(f.get('type'))} {escape(default)}")
    return "\n".join(lines) if lines else "no workflow types"


# -- each command's result ----------------------------------------------------------------------


def show(command: str, result: Any, style: Style = PLAIN) -> str:
    """Return a command's result as text for people."""
    match command, result:
        case "ping", {"version": version, "workflows": dict(counts)}:
            summary = ", ".join(f"{n} {cell(s)}" for s, n in sorted(counts.items()))
            summary = summary or "no workflows"
            nodes = result.get("nodes") or []
            if len(nodes) > 1:  # several daemons share a PostgreSQL database: name them all
                summary += "; nodes: " + ", ".join(
                    f"{cell(n.get('node_id'))} ({cell(n.get('role'))})" for n in nodes
                )
            return f"workflowd {cell(version)}: {summary}"
        case "cancel", {"workflow_id": wid, "status": status}:
            return f"{cell(wid)}: {style.status(cell(status))}"
        case "list", list(rows):
            columns = ["workflow_id", "workflow", "status", "updated_at", "waiting_for"]
            return table(rows, columns, style) if rows else "no workflows"
        case "history", list(rows):
            # A repair's before-image (for undo) is too big for a table; --json shows it.
            rows = [
                {k: v for k, v in r.items() if k != "undo"} if isinstance(r, dict) else {}
                for r in rows
            ]
            found = dict.fromkeys(k for r in rows for k in r)
            columns = [
                "at",
                "kind",
                "thread",
                *(k for k in found if k not in ("at", "kind", "thread")),
            ]
            return table(rows, columns, style, status="") if rows else "no history"
        case "show", dict():
            return describe(result, style)
        case "send", str(text):
            return escape(text)
        case "send", None:
            return "delivered"
        case "send", {"queued": True}:
            return "queued"
        case "graph", str(text):
            return escape(text.rstrip("\n"))
        case "lint", list(rows):
            columns = ["level", "code", "statement", "message"]
            return table(rows, columns, style) if rows else "no findings"
        case "types", list(rows):
            return types_text(rows)
        case "reload", {"reloaded": bool()}:
            return reload_text(result)
        case "backup", {"path": str(path), "bytes": int(size), **rest}:
            deleted = rest.get("deleted") or []
            names = ", ".join(cell(d) for d in deleted) if isinstance(deleted, list) else ""
            pruned = f"; deleted the oldest: {names}" if deleted else ""
            return f"backed up to {cell(path)} ({size} bytes){pruned}"
        case "dashboard", {"url": str(url), "socket": str(path)}:
            return f"{cell(url)}  (served on the Unix socket {cell(path)})"
        case "dashboard", {"url": str(url)}:
            return cell(url)
        case "schedule list", list(rows):
            return schedules_table(rows, style) if rows else "no schedules"
        case "schedule show", {"name": str(), "fires": list()}:
            return schedule_text(result)
        case "schedule pause" | "schedule resume", {"name": name, "paused": bool(paused)}:
            return f"{cell(name)}: {'paused' if paused else 'resumed'}"
        case "schedule trigger", {"workflow_id": wid, "status": status}:
            return f"{cell(wid)}: {style.status(cell(status))}"
    return escape(pretty(result))


def started_text(result: dict[str, Any], shown: dict[str, Any], style: Style = PLAIN) -> str:
    """Return what `start` prints: the id, and what the workflow waits for or does next."""
    wid, status = cell(result.get("workflow_id")), cell(shown.get("status"))
    head = f"{wid}: {style.status(status)}" + ("" if result.get("created", True) else " (existed)")
    if shown.get("held"):
        return f"{head}, held (`workflowctl resume {wid}` lets it run)"
    waits = shown.get("waiting_for") or []
    if status == "Waiting" and waits:
        return f"{head} for {cell(waits)}"
    running = shown.get("running_step")
    if isinstance(running, dict):
        return f"{head}, running step {cell(running.get('step'))}"
    retry = shown.get("retry")
    if isinstance(retry, dict):
        return f"{head}, step {cell(retry.get('step'))} failed, retried: {cell(shown.get('error'))}"
    if shown.get("error"):
        return f"{head}: {cell(shown['error'])}"
    return head


def schedules_table(rows: list[dict[str, Any]], style: Style = PLAIN) -> str:
    """Return `schedule list` rows as a table (times in local time)."""
    shown = [
        {
            "name": r.get("name"),
            "workflow": r.get("workflow"),
            "spec": r.get("spec"),
            "tz": r.get("tz"),
            "next": cell(r.get("next_fire_at"), "next_fire_at"),
            "last": cell(r.get("last_fire_at"), "last_fire_at"),
            "last_result": r.get("last_status") or "",
            "paused": "yes" if r.get("paused") else "no",
        }
        for r in rows
    ]
    return table(shown, list(shown[0]), style, status="last_result")


def schedule_text(result: dict[str, Any]) -> str:
    """Return `schedule show`: its settings and state, then its fires oldest first."""
    c = {k: cell(v) for k, v in result.items() if k != "fires"}
    last = c.get("last_workflow_id")
    lines = [
        f"name:      {c.get('name')}",
        f"workflow:  {c.get('workflow')}  input: {cell(result.get('input') or {})}",
        f"spec:      {c.get('spec')} ({c.get('tz')})",
        f"catchup:   {c.get('catchup')} (window {c.get('catchup_window_s')} s)",
        f"overlap:   {c.get('overlap')}  jitter: {c.get('jitter_s')} s",
        f"next fire: {cell(result.get('next_fire_at'), 'at') or '-'}",
        f"last fire: {cell(result.get('last_fire_at'), 'at') or '-'}"
        + (f"  {last} ({c.get('last_status') or 'deleted'})" if last else ""),
        f"paused:    {'yes' if result.get('paused') else 'no'}",
    ]
    if result.get("buffered_at") is not None:
        lines.append(f"buffered:  {cell(result['buffered_at'], 'at')}")
    fires = result["fires"]
    columns = ["at", "kind", "nominal_at", "workflow_id", "reason", "count"]
    return "\n".join([*lines, "", table(fires, columns) if fires else "no fires yet"])


def reload_text(result: dict[str, Any]) -> str:
    """Return a reload's outcome, one blocking workflow per line."""
    if result["reloaded"]:
        lines = [f"reloaded: {cell(result.get('workflows', []))}"]
        if result.get("needs_restart"):
            lines.append(f"needs a restart: {cell(result['needs_restart'])}")
        held = result.get("incompatible") or []
        if held:
            count = result.get("incompatible_count", len(held))
            lines.append(f"still held, {cell(count)} workflow(s) do not fit the new code:")
            for h in held:
                lines.append(
                    f"  {cell(h.get('workflow_id'))} ({cell(h.get('workflow'))}): "
                    f"{cell(h.get('reason'))}"
                )
        return "\n".join(lines)
    lines = [f"reload refused: {cell(result.get('error', ''))}; still running the old code"]
    for b in result.get("blocked", []):
        wid, wf, why = cell(b.get("workflow_id")), cell(b.get("workflow")), cell(b.get("reasons"))
        lines.append(f"  {wid} ({wf}): {why}")
    return "\n".join(lines)
