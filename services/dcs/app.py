"""The coordinator's HTTP API (FastAPI): authentication, error mapping and the routers of routes.py."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.dcs.config import DCSConfig
from services.dcs.routes import (
    health_router, lifecycle_router, node_router, run_router, sync_router, weight_router,
)
from services.dcs.state import Conflict, Missing, RedisState
from services.dcs.step_routes import steps_router
from services.runtime.redis_events import RedisEvents
from services.runtime.validation_errors import answer_validation_errors_without_input

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
HTTP_TOTAL = Counter("sluice_dcs_http_total", "DCS requests", ["route", "status"])


def build_app(config: DCSConfig, state: RedisState, events: RedisEvents) -> FastAPI:
    app = FastAPI(title="Sluice DCS", version="1",
                  description="Control plane: nodes, topology, weight versions, sync groups, run control.")
    expected = f"Bearer {config.auth_token}".encode()

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        path = request.url.path
        if config.auth_token and path not in OPEN_PATHS:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                HTTP_TOTAL.labels("unauthenticated", "401").inc()
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        response = await call_next(request)
        route = request.scope.get("route")
        HTTP_TOTAL.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    answer_validation_errors_without_input(app)

    @app.exception_handler(Missing)
    async def _missing(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Conflict)
    async def _conflict(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_down(request, exc):
        return JSONResponse({"detail": f"state store unreachable: {exc}"}, status_code=503)

    for router in (health_router(state), node_router(config, state), weight_router(config, state, events),
                   sync_router(state), run_router(state), lifecycle_router(state), steps_router(state)):
        app.include_router(router)
    return app
