"""Serve an ASGI app with uvicorn until the service's stop event (SIGTERM/SIGINT) is set."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

from services.runtime.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from services.runtime.tls import TLSSettings


class _Server(uvicorn.Server):
    def capture_signals(self):
        # the service's own handler (runtime.shutdown) decides when to stop
        return contextlib.nullcontext()


async def serve_http(
    app,
    host: str,
    port: int,
    stop: asyncio.Event,
    tls: TLSSettings | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Returns once `stop` is set (or the server exits) and in-flight requests have finished. HTTPS when `tls`
    names a certificate (services/runtime/tls.py). Request bodies over `max_body_bytes` get 413
    (services/runtime/body_limit.py)."""
    options = tls.uvicorn_options() if tls is not None else {}
    server = _Server(
        uvicorn.Config(
            BodyLimit(app, max_body_bytes),
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            **options,
        )
    )
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        server.should_exit = True
        stopping.cancel()
        await asyncio.gather(serving, stopping, return_exceptions=True)
