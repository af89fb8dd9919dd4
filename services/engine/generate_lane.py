"""POST /generate on a lane in front of the engine's whole FastAPI app (`GenerateLane`).

The engine's event loop shares the GIL with the engine thread, so every bit of CPU it spends on a request is
time the forward pass waits. Measured with py-spy on the engine over 64-request rounds of the tiny model
(`benchmarks/engine_throughput.py --preset tiny`): a /generate request that went through FastAPI's stack
(its middleware layers, routers and exception wrappers) spent ~2/3 of the event loop's CPU outside the route's
own work. The lane answers /generate straight from the ASGI scope: the bearer token check of every route,
one pydantic parse and validation of the body, `answer_generate` (generate_routes.py), and the same error
bodies as the app's handlers (400 with a message naming the field, 503 with Retry-After). Every other
request, and the OpenAPI document describing /generate, is the app's."""

from __future__ import annotations

from fastapi import Request, Response
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from services.engine.generate_routes import (
    BadRequest,
    Unavailable,
    answer_generate,
    error_response,
    refusal,
    validation_message,
)
from services.engine.protocol import GenerateRequest
from services.runtime.http_auth import BearerTokenGate


class GenerateLane:
    """ASGI app: POST /generate answered here, everything else handed to `app`. `token`: the bearer token
    every request must carry ("" when auth is off)."""

    def __init__(self, app: ASGIApp, engine, token: str):
        self.app, self.engine = app, engine
        self.generate = BearerTokenGate(self._generate, token, ()) if token else self._generate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        await self.generate(scope, receive, send)

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.answer(Request(scope, receive))
        await response(scope, receive, send)

    async def answer(self, request: Request) -> Response:
        try:
            req = GenerateRequest.model_validate_json(await request.body())
            return await answer_generate(self.engine, req, request)
        except ValidationError as exc:
            return error_response(validation_message(exc.errors()))
        except (BadRequest, Unavailable) as exc:
            return refusal(exc)
