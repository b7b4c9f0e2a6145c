"""The dashboard's HTML, rendered on the server; every value is escaped."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import urlencode

#: The statuses a workflow can have, in the order the counts show them.
STATUSES = ("Resuming", "Waiting", "Failed", "Finished", "Cancelled")


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def when(value: Any) -> str:
    """Return Unix seconds as an ISO time (UTC), or "" for none."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return ""
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def page(title: str, content: str, *, fragment: str = "", events: str = "") -> str:
    """Wrap a page's content: header, stylesheet, script, and where its live parts come from."""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_e(title)} · workflowd</title>"
        '<link rel=stylesheet href="/static/style.css"></head>'
        f'<body data-fragment="{_e(fragment)}" data-events="{_e(events)}" data-live="off">'
        '<header><strong>workflowd</strong><a href="/">workflows</a>'
        '<a href="/schedules">schedules</a></header>'
        f"<main>{content}</main>"
        '<script src="/static/app.js"></script></body></html>'
    )


def workflow_link(wid: str) -> str:
    """Return a link to one workflow's page."""
    return f'<a href="/workflow?{urlencode({"id": wid})}">{_e(wid)}</a>'


def filters(status: str, workflow: str, types: Sequence[str]) -> str:
    """Return the list page's filter form."""

    def select(name: str, chosen: str, options: Iterable[str], empty: str) -> str:
        opts = [f'<option value="">{_e(empty)}</option>']
        for o in options:
            sel = " selected" if o == chosen else ""
            opts.append(f'<option value="{_e(o)}"{sel}>{_e(o)}</option>')
        return f'<select name="{name}" id="filter-{name}">{"".join(opts)}</select>'

    return (
        '<form method="get" action="/" id="filters">'
        + select("status", status, STATUSES, "any status")
        + select("workflow", workflow, types, "any type")
        + '<button type="submit">filter</button></form>'
    )


def workflow_list(counts: Mapping[str, int], rows: Sequence[Mapping[str, Any]]) -> str:
    """Return the list page's live part: counts by status and the table."""
    shown = [s for s in STATUSES if s in counts] + sorted(set(counts) - set(STATUSES))
    count_html = "".join(
        f'<span class="count status-{_e(s)}" data-status="{_e(s)}">{_e(s)}: '
        f'<b class="n">{counts[s]}</b></span>'
        for s in shown
    )
    body = "".join(
        f'<tr data-id="{_e(r["workflow_id"])}"><td>{workflow_link(r["workflow_id"])}</td>'
        f"<td>{_e(r['workflow'])}</td>"
        f'<td class="status status-{_e(r["status"])}">{_e(r["status"])}</td>'
        f"<td>{_e(', '.join(r.get('waiting_for') or []))}</td>"
        f"<td>{_e(when(r.get('updated_at')))}</td><td>{_e(r.get('error'))}</td></tr>"
        for r in rows
    )
    return (
        f'<p class="counts" id="counts">{count_html or "no workflows"}</p>'
        '<table id="workflows"><thead><tr><th>id</th><th>type</th><th>status</th>'
        f"<th>waiting for</th><th>updated</th><th>error</th></tr></thead><tbody>{body}</tbody>"
        "</table>"
    )


def _button(action: str, wid: str, label: str, key: str) -> str:
    question = f"{label} workflow {wid}?"
    return (
        f'<form class="inline" method="post" action="/workflow/{action}"'
        f' data-confirm="{_e(question)}" id="{action}-form">'
        f'<input type="hidden" name="id" value="{_e(wid)}">'
        f'<input type="hidden" name="key" value="{_e(key)}">'
        f'<button type="submit" id="{action}">{_e(label)}</button></form>'
    )


def workflow_detail(
    shown: Mapping[str, Any], history: Sequence[Mapping[str, Any]], svg: str, key: str
) -> str:
    """Return one workflow's live part: status, buttons, graph, data and history."""
    wid, status = shown["workflow_id"], shown["status"]
    buttons = ""
    if status not in ("Finished", "Failed", "Cancelled"):
        buttons += _button("cancel", wid, "Cancel", key)
    if status == "Failed":
        buttons += _button("retry", wid, "Retry", key)
    rows = "".join(
        f"<tr><td>{_e(when(h.get('at')))}</td><td>{_e(h.get('kind'))}</td>"
        f"<td>{_e(json.dumps({k: v for k, v in h.items() if k not in ('at', 'kind')}))}</td></tr>"
        for h in history
    )
    error = f'<p class="error">error: {_e(shown.get("error"))}</p>' if shown.get("error") else ""
    return (
        f'<p>status: <b id="status" class="status-{_e(status)}">{_e(status)}</b>'
        f" · waiting for: {_e(', '.join(shown.get('waiting_for') or []) or '-')}</p>"
        f"{error}<p>{buttons}</p>"
        f'<div class="graph" id="graph">{svg}</div>'
        f'<h3>data</h3><pre id="data">{_e(json.dumps(shown.get("data"), indent=2))}</pre>'
        '<h3>history</h3><table id="history"><thead><tr><th>at</th><th>kind</th>'
        f"<th>detail</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def schedules_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Return the schedules page's table."""
    body = "".join(
        f"<tr><td>{_e(r.get('name'))}</td><td>{_e(r.get('workflow'))}</td>"
        f"<td>{_e(r.get('spec'))} {_e(r.get('tz'))}</td>"
        f"<td>{_e(when(r.get('next_fire_at')))}</td><td>{_e(when(r.get('last_fire_at')))}</td>"
        f"<td>{workflow_link(r['last_workflow_id']) if r.get('last_workflow_id') else ''}"
        f" {_e(r.get('last_status'))}</td><td>{'yes' if r.get('paused') else ''}</td></tr>"
        for r in rows
    )
    return (
        '<table id="schedules"><thead><tr><th>name</th><th>workflow</th><th>when</th>'
        "<th>next fire</th><th>last fire</th><th>last workflow</th><th>paused</th></tr>"
        f"</thead><tbody>{body or '<tr><td colspan=7>no schedules</td></tr>'}</tbody></table>"
    )
