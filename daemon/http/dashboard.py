"""The dashboard: routes, the token check, cancel/retry, and live updates over Server-Sent Events."""

from __future__ import annotations

import builtins
import html
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import urlencode

import anyio
import structlog

from daemon.errors import WorkflowdError
from daemon.http import pages
from daemon.http.assets import SCRIPT, STYLE
from daemon.http.server import Request, Response, Send, text
from daemon.http.token import form_key, same

log = structlog.get_logger()
COOKIE = "workflowd_dashboard"
#: Log events after which a page's live part is fetched again.
CHANGES = frozenset(
    {
        "workflow_started", "workflow_finished", "workflow_failed", "workflow_cancelled",
        "callback_received", "step_done", "step_failed", "handler_failed", "workflow_released",
        "workflow_fits", "goto", "edit", "retry",
    }
)  # fmt: skip
#: An SSE comment this often tells a client that went away from one that is listening.
KEEPALIVE_S = 15.0
#: The workflows a list page shows.
LIST_LIMIT = 200
HTML = "text/html; charset=utf-8"


class Workflows(Protocol):
    """What the dashboard reads and does through the runtime."""

    async def list(
        self, *, status: str | None = None, workflow: str | None = None, limit: int = 100
    ) -> builtins.list[dict[str, Any]]: ...
    async def show(self, workflow_id: str) -> dict[str, Any]: ...
    async def history(
        self, workflow_id: str, *, limit: int = 1000
    ) -> builtins.list[dict[str, Any]]: ...
    async def cancel(self, workflow_id: str, *, by: str | None = None) -> dict[str, Any]: ...
    async def counts(self) -> dict[str, int]: ...
    def subscribe_logs(
        self, workflow_id: str | None = None, *, follow: bool = True
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]: ...


class Tools(Protocol):
    """The operator's tools the dashboard uses (daemon.ops.repairs)."""

    async def graph(self, workflow: str, workflow_id: str | None, format: str) -> str: ...
    async def retry(
        self, workflow_id: str, *, who: int | None = None, by: str | None = None
    ) -> dict[str, Any]: ...


class Timetable(Protocol):
    """The schedules the dashboard lists (daemon.runtime.schedules)."""

    async def list(self) -> builtins.list[dict[str, Any]]: ...


class Dashboard:
    """Serves the dashboard to holders of the token; everyone else gets 401."""

    def __init__(
        self,
        *,
        token: str,
        workflows: Workflows,
        tools: Tools,
        timetable: Timetable | None,
        types: Callable[[], Sequence[str]],
    ) -> None:
        self._token, self._key = token, form_key(token)
        self._wf, self._tools, self._timetable, self._types = workflows, tools, timetable, types

    async def __call__(self, request: Request) -> Response:
        """Answer one request."""
        if request.path.startswith("/static/"):
            return _static(request.path)
        given = request.query.get("token")
        if given is not None:
            if not same(given, self._token):
                return _denied()
            # The token leaves the address bar (and the history) for an HttpOnly cookie.
            rest = {k: v for k, v in request.query.items() if k != "token"}
            where = request.path + (f"?{urlencode(rest)}" if rest else "")
            cookie = f"{COOKIE}={self._token}; HttpOnly; SameSite=Strict; Path=/"
            return Response(303, b"", headers=[("Location", where), ("Set-Cookie", cookie)])
        if not same(request.cookie(COOKIE), self._token):
            return _denied()
        try:
            return await self._route(request)
        except WorkflowdError as e:
            status = {"not_found": 404, "conflict": 409}.get(e.code, 400)
            return text(status, f"{e.code}: {e}")

    async def _route(self, r: Request) -> Response:
        q = r.query
        match r.method, r.path:
            case "GET", "/":
                return _html(await self._list_page(q.get("status", ""), q.get("workflow", "")))
            case "GET", "/fragment/list":
                return _html(await self._list_part(q.get("status", ""), q.get("workflow", "")))
            case "GET", "/workflow":
                return _html(await self._workflow_page(q.get("id", "")))
            case "GET", "/fragment/workflow":
                return _html(await self._workflow_part(q.get("id", "")))
            case "GET", "/schedules":
                rows = await self._timetable.list() if self._timetable is not None else []
                return _html(pages.page("schedules", pages.schedules_table(rows)))
            case "GET", "/events":
                return _events(self._wf, q.get("workflow_id") or None)
            case "POST", "/workflow/cancel" | "/workflow/retry":
                return await self._act(r.path.rsplit("/", 1)[1], r.form())
            case _, "/" | "/workflow" | "/schedules" | "/events" | "/workflow/cancel":
                return text(405, "method not allowed")
            case _:
                return text(404, "not found")

    async def _list_page(self, status: str, workflow: str) -> str:
        query = urlencode({k: v for k, v in (("status", status), ("workflow", workflow)) if v})
        content = (
            "<h2>workflows</h2>"
            + pages.filters(status, workflow, sorted(self._types()))
            + f'<div id="live">{await self._list_part(status, workflow)}</div>'
        )
        return pages.page(
            "workflows", content, fragment=f"/fragment/list?{query}", events="/events"
        )

    async def _list_part(self, status: str, workflow: str) -> str:
        rows = await self._wf.list(
            status=status or None, workflow=workflow or None, limit=LIST_LIMIT
        )
        return pages.workflow_list(await self._wf.counts(), rows)

    async def _workflow_page(self, wid: str) -> str:
        shown = await self._wf.show(wid)
        ids = urlencode({"id": wid})
        content = (
            f"<h2>{pages.workflow_link(wid)} <small>{shown['workflow']}</small></h2>"
            f'<div id="live">{await self._workflow_part(wid, shown)}</div>'
            '<h3>log</h3><pre id="log"></pre>'
        )
        return pages.page(
            wid,
            content,
            fragment=f"/fragment/workflow?{ids}",
            events=f"/events?{urlencode({'workflow_id': wid})}",
        )

    async def _workflow_part(self, wid: str, shown: dict[str, Any] | None = None) -> str:
        shown = shown or await self._wf.show(wid)
        history = await self._wf.history(wid, limit=200)
        try:
            svg = await self._tools.graph(shown["workflow"], wid, "svg")
        except WorkflowdError as e:  # its type is gone from the code, say
            svg = f"<p>no graph: {html.escape(str(e))}</p>"
        return pages.workflow_detail(shown, history, svg, self._key)

    async def _act(self, action: str, form: dict[str, str]) -> Response:
        if not same(form.get("key"), self._key):
            return text(403, "this form did not come from the dashboard")
        wid = form.get("id", "")
        if action == "cancel":
            result = await self._wf.cancel(wid, by="dashboard")
        else:
            result = await self._tools.retry(wid, by="dashboard")
        log.info("dashboard_action", action=action, workflow_id=wid, status=result.get("status"))
        where = f"/workflow?{urlencode({'id': wid})}"
        return Response(303, b"", headers=[("Location", where)])


def _html(body: str) -> Response:
    return Response(200, body.encode(), HTML)


def _denied() -> Response:
    body = pages.page(
        "access needed",
        "<h2>401: access needed</h2><p>Open the address <code>workflowctl dashboard</code>"
        " prints; it carries the access token.</p>",
    )
    return Response(401, body.encode(), HTML)


def _static(path: str) -> Response:
    if path == "/static/app.js":
        return Response(200, SCRIPT.encode(), "text/javascript; charset=utf-8")
    if path == "/static/style.css":
        return Response(200, STYLE.encode(), "text/css; charset=utf-8")
    return text(404, "not found")


def _events(wf: Workflows, workflow_id: str | None) -> Response:
    """Stream `change` (and, for one workflow, `log`) events as the log records come."""
    since = datetime.now(UTC).isoformat().replace("+00:00", "Z")

    async def stream(send: Send) -> None:
        async def keepalive() -> None:
            while True:
                await anyio.sleep(KEEPALIVE_S)
                await send(b": keepalive\n\n")

        async with (
            wf.subscribe_logs(workflow_id, follow=True) as records,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(keepalive)
            await send(b"retry: 2000\n\n")
            async for record in records:
                await _forward(send, record, workflow_id, since)
            tg.cancel_scope.cancel()

    return Response(200, content_type="text/event-stream", stream=stream)


async def _forward(
    send: Callable[[bytes], Awaitable[None]],
    record: dict[str, Any],
    workflow_id: str | None,
    since: str,
) -> None:
    fresh = str(record.get("timestamp", "")) >= since
    if workflow_id is not None:  # one workflow's page: its log, recent records too
        data = json.dumps(record, default=str)
        await send(f"event: log\ndata: {data}\n\n".encode())
    if fresh and record.get("event") in CHANGES:
        about = {"workflow_id": record.get("workflow_id"), "event": record.get("event")}
        await send(f"event: change\ndata: {json.dumps(about, default=str)}\n\n".encode())
