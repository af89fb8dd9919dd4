"""Bearer-token authentication of a service's HTTP routes (the coordinator's, the engine's and every role's
status server): a request without `Authorization: Bearer <token>` gets 401 before any route runs, so a
refused call changes nothing. Only liveness/readiness paths stay open: probes cannot carry a secret.

The gates here are plain ASGI middleware, not Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`):
that one runs every request's app in a task group behind memory streams, which on the engine's event loop
(it shares the GIL with the engine thread) cost the generation benchmark measurable time (docs/performance.md)."""

from __future__ import annotations

import hmac
from typing import Callable, Iterable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send


def bearer_matches(header: str, token: str) -> bool:
    """Constant-time comparison of an Authorization header with `Bearer <token>`."""
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def unauthenticated() -> JSONResponse:
    return JSONResponse(
        {"detail": "missing or wrong bearer token"}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
    )


def header(scope: Scope, name: bytes) -> bytes:
    """The first value of header `name` (lower case) of an HTTP or websocket scope, b"" when absent."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return b""


class BearerTokenGate:
    """ASGI middleware: 401 unless the request carries `Bearer <token>`; `open_paths`, and paths under
    `own_gates` (whose routes check a credential of their own), pass without it."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        open_paths: Iterable[str],
        on_refused: Callable[[], None] | None = None,
        own_gates: Iterable[str] = (),
    ):
        self.app, self.open_paths, self.on_refused = app, frozenset(open_paths), on_refused
        self.own_gates = tuple(own_gates)
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or scope["path"] in self.open_paths
            or (self.own_gates and scope["path"].startswith(self.own_gates))
            or hmac.compare_digest(header(scope, b"authorization"), self.expected)
        ):
            return await self.app(scope, receive, send)
        if self.on_refused is not None:
            self.on_refused()
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await unauthenticated()(scope, receive, send)


class PathRefusal:
    """ASGI middleware: `response` (a fixed Starlette response) for every request to one of `paths`."""

    def __init__(self, app: ASGIApp, paths: Iterable[str], response):
        self.app, self.paths, self.response = app, frozenset(paths), response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            return await self.response(scope, receive, send)
        await self.app(scope, receive, send)


def require_bearer_token(
    app: FastAPI,
    token: str,
    open_paths: Iterable[str],
    on_refused: Callable[[], None] | None = None,
    own_gates: Iterable[str] = (),
) -> None:
    """Every path of `app` but `open_paths` answers 401 unless the request carries the token; no-op when the
    token is empty (auth off). Paths under a prefix in `own_gates` are left to their routes, which check a
    credential of their own (an agent episode's key). `on_refused` runs for each refusal (a metric)."""
    if token:
        app.add_middleware(
            BearerTokenGate, token=token, open_paths=open_paths, on_refused=on_refused, own_gates=own_gates
        )
