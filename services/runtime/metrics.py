"""Prometheus /metrics endpoint for services."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)


def serve_metrics(host: str, port: int) -> int:
    """Serve /metrics from the default registry on a daemon thread; port 0 disables it."""
    if port <= 0:
        return 0
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    log.info("metrics endpoint up", extra={"metrics_port": bound})
    return bound
