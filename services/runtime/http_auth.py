"""Bearer-token authentication of a service's HTTP routes (the coordinator's, the engine's and every role's
status server): a request without `Authorization: Bearer <token>` gets 401 before any route runs, so a
refused call changes nothing. Only liveness/readiness paths stay open: probes cannot carry a secret."""

from __future__ import annotations

import hmac
from typing import Callable, Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def bearer_matches(header: str, token: str) -> bool:
    """Constant-time comparison of an Authorization header with `Bearer <token>`."""
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def unauthenticated() -> JSONResponse:
    return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


def require_bearer_token(app: FastAPI, token: str, open_paths: Iterable[str],
                         on_refused: Callable[[], None] | None = None) -> None:
    """Every path of `app` but `open_paths` answers 401 unless the request carries the token; no-op when the
    token is empty (auth off). `on_refused` runs for each refusal (a metric)."""
    if not token:
        return
    open_paths = frozenset(open_paths)

    @app.middleware("http")
    async def bearer_auth(request: Request, call_next):
        if request.url.path in open_paths or bearer_matches(request.headers.get("authorization", ""), token):
            return await call_next(request)
        if on_refused is not None:
            on_refused()
        return unauthenticated()
