"""`/metrics`: the gauges are read from the store just before the text is rendered."""

from __future__ import annotations

from collections.abc import Callable

from daemon.http.server import Handler, Request, Response, text
from daemon.observe.metrics import CONTENT_TYPE, OPENMETRICS_TYPE, Metrics
from daemon.store.base import Gauges


def metrics_handler(
    metrics: Metrics, *, gauges: Gauges, waits: Callable[[], dict[str, int]]
) -> Handler:
    """Return the handler that serves `GET /metrics` (anything else is 404)."""

    async def handle(request: Request) -> Response:
        if request.path != "/metrics":
            return text(404, "not found; try /metrics")
        if request.method not in ("GET", "HEAD"):
            return text(405, "method not allowed")
        metrics.set_snapshot(
            workflows=await gauges.counts_by_type(),
            inbox=await gauges.inbox_depth(),
            waits=waits(),
        )
        # Prometheus asks for OpenMetrics when it can take it; anything else gets the classic text.
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            return Response(200, metrics.render(openmetrics_format=True), OPENMETRICS_TYPE)
        return Response(200, metrics.render(), CONTENT_TYPE)

    return handle
