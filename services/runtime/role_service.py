"""What every role service (rollout, forward, advantage, trainer) shares around its step loop:
the connection settings, an HTTP endpoint with /healthz, /readyz, /status and /metrics, and the
bridge from SIGTERM to the loop's stop flag. The loop itself lives in the role's package."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field
from pydantic_settings import BaseSettings

from services.runtime.http_service import serve_http
from services.runtime.metrics import observability_router

log = logging.getLogger(__name__)


class RoleSettings(BaseSettings):
    """Connection settings of a role service; the run's own configuration comes from the coordinator."""

    run_id: str = Field("default", description="the run (created on the coordinator) this service works for")
    dcs_url: str = Field("http://127.0.0.1:7300", description="coordinator base URL")
    tq_controller: str = Field("127.0.0.1:7400", description="TransferQueue controller host:port")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for run state (ledger, progress)")
    auth_token: str = Field("", description="bearer token for the coordinator and TransferQueue")
    host: str = Field("0.0.0.0", description="address of the health/status/metrics endpoint")
    port: int = Field(0, ge=0, le=65535, description="port of /healthz /readyz /status /metrics; 0 = any free port")
    advertise_host: str = Field("127.0.0.1", description="address other nodes reach this one at")
    log_level: str = Field("info", description="debug|info|warning|error")


class RoleStatus:
    """What /status and /readyz report; the loop updates it."""

    def __init__(self, role: str):
        self.role = role
        self.ready = False
        self.fields: dict[str, Any] = {"state": "starting"}
        self._lock = threading.Lock()

    def running(self) -> None:
        self.ready = True
        self.update(state="running")

    def idle(self, why: str) -> None:
        """Ready, but this run has nothing for it to do."""
        self.ready = True
        self.update(state="idle", reason=why)

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.fields.update(fields)

    def snapshot(self) -> dict:
        with self._lock:
            return {"role": self.role, "ready": self.ready, **self.fields}


def build_status_app(status: RoleStatus) -> FastAPI:
    app = FastAPI(title=f"sluice {status.role}", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/readyz")
    async def readyz():
        return JSONResponse({"ready": status.ready}, status_code=200 if status.ready else 503)

    @app.get("/status")
    async def current():
        return status.snapshot()

    app.include_router(observability_router())
    return app


async def serve_role(config: RoleSettings, stop: asyncio.Event, status: RoleStatus,
                     loop: Callable[[threading.Event], None] | None = None,
                     aloop: Callable[[asyncio.Event], Awaitable[None]] | None = None) -> None:
    """Serve the status endpoint while the step loop runs; SIGTERM sets the loop's stop flag and the
    loop returns at its next safe point. A loop that raises takes the service down (non-zero exit)."""
    halt = threading.Event()
    finished = asyncio.Event()
    http_stop = asyncio.Event()
    http = asyncio.create_task(serve_http(build_status_app(status), config.host, config.port, http_stop))

    async def run_loop() -> None:
        try:
            if aloop is not None:
                await aloop(stop)
            else:
                await asyncio.to_thread(loop, halt)
        finally:
            finished.set()

    worker = asyncio.create_task(run_loop())
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([worker, waiter], return_when=asyncio.FIRST_COMPLETED)
        if not worker.done():
            log.info("stopping at the next safe point")
            halt.set()
        await worker  # re-raises the loop's error
        status.update(state="finished")
        log.info("step loop finished")
        if not stop.is_set():  # done with the run: keep answering health until told to stop
            await stop.wait()
    finally:
        halt.set()
        waiter.cancel()
        http_stop.set()
        await asyncio.gather(http, return_exceptions=True)
