"""The coordinator's HTTP API (FastAPI): authentication, error mapping and the routers of routes.py."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.dcs.config import DCSConfig
from services.dcs.engine_routes import engine_router
from services.dcs.engine_set import EngineSets
from services.dcs.routes import health_router, lifecycle_router, node_router, run_router, sync_router, weight_router
from services.dcs.state import Conflict, Missing, RedisState
from services.dcs.step_records import StepRecords
from services.dcs.step_routes import steps_router
from services.dcs.sync_groups import SyncGroups
from services.runtime.http_auth import require_bearer_token
from services.runtime.redis_events import RedisEvents
from services.runtime.validation_errors import answer_validation_errors_without_input

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
HTTP_TOTAL = Counter("sluice_dcs_http_total", "DCS requests", ["route", "status"])


class RequestCounter:
    """ASGI middleware counting requests by route template and status (HTTP_TOTAL)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:  # the router put the matched route into the scope
            route = getattr(scope.get("route"), "path", "unmatched")
            HTTP_TOTAL.labels(route, str(status[0]) if status else "500").inc()


def build_app(config: DCSConfig, state: RedisState, events: RedisEvents) -> FastAPI:
    app = FastAPI(
        title="Sluice DCS",
        version="1",
        description="Control plane: nodes, topology, weight versions, sync groups, run control.",
    )
    app.add_middleware(RequestCounter)
    require_bearer_token(app, config.auth_token, OPEN_PATHS, on_refused=HTTP_TOTAL.labels("unauthenticated", "401").inc)

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

    engines = EngineSets(state)
    for router in (
        health_router(state),
        node_router(config, state, engines),
        weight_router(config, state, events),
        sync_router(SyncGroups(state)),
        run_router(state),
        lifecycle_router(state),
        steps_router(StepRecords(state)),
        engine_router(engines),
    ):
        app.include_router(router)
    return app
