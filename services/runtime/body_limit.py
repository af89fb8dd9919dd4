"""A cap on HTTP request bodies, in front of every service's app (serve_http): a body over the cap gets 413
with a message and never reaches a route, so no request, however large, can exhaust a service's memory.
uvicorn and Starlette read a whole body into memory with no limit of their own.

A declared Content-Length over the cap is refused before any byte is read; a chunked body is counted as it
arrives and refused at the first chunk that passes the cap. (Raising from inside the app instead would meet
Starlette's error middleware first, which answers 500.)"""

from __future__ import annotations

import json

DEFAULT_MAX_BODY_BYTES = 64 << 20  # a /generate batch of 4,096 prompts of 2,048 ids is ~50 MB of JSON


class BodyLimit:
    """ASGI middleware: 413 for request bodies over `max_bytes`. The body is read here, up to the cap, and
    handed on in one message (every route of these services reads its whole JSON body anyway); later
    receives (a client's disconnect) go to the server as before."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was in
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = json.dumps({"detail": f"request body over {self.max_bytes} bytes"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
