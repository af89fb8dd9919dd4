"""Prometheus /metrics for services: a separate metrics port, or /metrics and /spans as FastAPI routes."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest, start_http_server

from services.runtime.spans import RECORDER

log = logging.getLogger(__name__)


def serve_metrics(host: str, port: int) -> int:
    """Serve /metrics from the default registry on a daemon thread; port 0 disables it."""
    if port <= 0:
        return 0
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    log.info("metrics endpoint up", extra={"metrics_port": bound})
    return bound


_GAUGES: dict[str, Gauge] = {}


def gauges(prefix: str, names: dict[str, str]) -> dict[str, Gauge]:
    """A set of gauges `{prefix}_{name}`, created by the role that sets them (so an actor and a critic process
    each export only their own); a second role object in the process shares them."""
    for name, help_text in names.items():
        if f"{prefix}_{name}" not in _GAUGES:
            _GAUGES[f"{prefix}_{name}"] = Gauge(f"{prefix}_{name}", help_text)
    return {name: _GAUGES[f"{prefix}_{name}"] for name in names}


def observability_router() -> APIRouter:
    """GET /metrics (Prometheus text) and GET /spans (recent work spans, services/runtime/spans.py)."""
    router = APIRouter(tags=["service"])

    @router.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/spans")
    async def spans(since: float = 0.0):
        """Recent spans (the service's working intervals, tagged with step and weight version) that ended
        after `since` (epoch seconds)."""
        return RECORDER.since(since)

    return router
