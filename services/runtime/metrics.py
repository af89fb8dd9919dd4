"""Prometheus /metrics endpoint for services."""

from __future__ import annotations

import logging

from prometheus_client import Gauge, start_http_server

log = logging.getLogger(__name__)


def serve_metrics(host: str, port: int) -> int:
    """Serve /metrics from the default registry on a daemon thread; port 0 disables it."""
    if port <= 0:
        return 0
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    log.info("metrics endpoint up", extra={"metrics_port": bound})
    return bound


def gauges(prefix: str, names: dict[str, str]) -> dict[str, Gauge]:
    """A set of gauges `{prefix}_{name}`, created by the role that sets them (so an actor and a critic process
    each export only their own)."""
    return {name: Gauge(f"{prefix}_{name}", help_text) for name, help_text in names.items()}
