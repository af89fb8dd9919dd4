"""The host every role service (rollout, forward, advantage, trainer) runs in:

    serve the status endpoint (/healthz, /readyz, /status, /metrics)
    wait for the run (one coordinator client: the run's lifecycle watch, run_watch.py, and the role's own calls)
    preflight what the role reads of the run
    open the role's session with the run (session.py) and run the role's loop with it, until it returns, SIGTERM,
        or the run failing or being stopped (the loop's stop flag); the role's fatal error is the run's failure

The loop itself lives in the role's package: `loop(session, halt)` on a thread, or `aloop(session, stop)` on
the service's event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Coroutine, Sequence

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field

from services.run_contract.preflight import check_run, describe
from services.run_contract.run_policy import RunPolicySettings
from services.run_contract.run_name import RunIdSettings
from services.runtime.auth_token import AuthTokenSettings
from services.runtime.tls import TLSSettings
from services.runtime.http_auth import require_bearer_token
from services.runtime.heap import freeze_heap
from services.runtime.http_service import serve_http
from services.runtime.processes import free_port
from services.runtime.metrics import observability_router
from services.runtime.dependency_errors import dependency_unavailable
from services.dcs.client import DCSClient
from services.role.run_watch import RunWatch, failure_message
from services.role.session import LiveRunSession, RunSession

log = logging.getLogger(__name__)


class RoleSettings(AuthTokenSettings, TLSSettings, RunPolicySettings, RunIdSettings):
    """Connection settings of a role service; the run's own configuration comes from the coordinator."""

    dcs_url: str = Field("http://127.0.0.1:7300", description="coordinator base URL")
    tq_controller: str = Field("127.0.0.1:7400", description="TransferQueue controller host:port")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for run state (ledger, progress)")
    host: str = Field("0.0.0.0", description="address of the health/status/metrics endpoint")
    port: int = Field(0, ge=0, le=65535, description="port of /healthz /readyz /status /metrics; 0 = any free port")
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="a second port serving only /metrics, without the "
        "token (for Prometheus scrapes inside the cluster); 0 = off",
    )
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
        """Set up (model loaded, connections open): what was made so far lives as long as the process."""
        if not self.ready:
            freeze_heap()
            log.info("role running", extra={"role": self.role})  # its start-up done (benchmarks/stack_start.py)
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


def build_status_app(status: RoleStatus, token: str = "", routers: Sequence[APIRouter] = ()) -> FastAPI:
    """/healthz and /readyz for probes; /status, /metrics, /spans, /openapi.json and the role's own `routers`
    need the token (if set), except a router's paths under its `own_gate` prefix (an attribute it may carry),
    whose routes check a credential of their own."""
    app = FastAPI(title=f"sluice {status.role}", docs_url=None, redoc_url=None)
    for router in routers:
        app.include_router(router)
    gates = [gate for router in routers if (gate := getattr(router, "own_gate", ""))]
    require_bearer_token(app, token, ("/healthz", "/readyz"), own_gates=gates)

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


class PreflightFailed(RuntimeError):
    """The run's config fails this role's preflight checks (services/run_contract/preflight.py)."""


ThreadLoop = Callable[[RunSession, threading.Event], None]
AsyncLoop = Callable[[RunSession, asyncio.Event], Coroutine[Any, Any, None]]


async def serve_role(
    config: RoleSettings,
    stop: asyncio.Event,
    status: RoleStatus,
    loop: ThreadLoop | None = None,
    aloop: AsyncLoop | None = None,
    watch_poll_s: float = 1.0,
    routers: Sequence[APIRouter] = (),
) -> None:
    """Serve the status endpoint; wait for the run and check what this role reads of it (preflight); then
    run the step loop. SIGTERM, or the run failing or being stopped, sets the loop's stop flag and the loop
    returns at its next safe point; the process then exits 0 (a finished loop whose run goes on, or whose
    run finished, keeps answering health until SIGTERM). A loop that raises, or a failed preflight, is
    reported as the run's failure and takes the service down (non-zero exit); an error that says a
    dependency is unreachable (runtime/dependency_errors.py) takes it down without failing the run."""
    http_stop = asyncio.Event()
    if not config.port:  # a free port now, so that the role knows where it serves (an agent's endpoint URL)
        config.port = free_port()
    app = build_status_app(status, config.auth_token, routers)
    http = asyncio.create_task(serve_http(app, config.host, config.port, http_stop, tls=config))
    dcs = DCSClient(config.dcs_url, token=config.auth_token or None)
    watch = RunWatch(dcs, config.run_id, status.role, watch_poll_s)
    try:
        run = await watch.wait_for_run(stop)
        if run is None or watch.ended:
            status.update(state=watch.status or "stopped")
            log.info("not starting: the run ended before this role started", extra={"status": watch.status})
            return
        problems = await asyncio.to_thread(check_run, run.config, status.role, config.run_policy())
        if problems:
            message = f"preflight: {describe(problems)}"
            status.update(state="failed", error=message)
            await watch.report_failure(message, config.advertise_host, config.port)
            raise PreflightFailed(message)
        await _run_loop(config, stop, status, watch, LiveRunSession(config, run.config, dcs), loop, aloop)
    finally:
        await asyncio.to_thread(dcs.close)
        http_stop.set()
        await asyncio.gather(http, return_exceptions=True)


async def _run_loop(
    config: RoleSettings,
    stop: asyncio.Event,
    status: RoleStatus,
    watch: RunWatch,
    session: LiveRunSession,
    loop: ThreadLoop | None,
    aloop: AsyncLoop | None,
) -> None:
    """The step loop until it returns, halted by SIGTERM or the run ending; its error reported."""
    halt = threading.Event()  # a thread loop's stop flag
    loop_stop = asyncio.Event()  # an asyncio loop's
    # serve_role is given a loop or an aloop
    worker = asyncio.create_task(
        aloop(session, loop_stop) if aloop is not None else asyncio.to_thread(loop, session, halt)  # type: ignore[arg-type]
    )
    waiter = asyncio.create_task(stop.wait())
    follower = asyncio.create_task(watch.until_ended())
    try:
        await asyncio.wait([worker, waiter, follower], return_when=asyncio.FIRST_COMPLETED)
        if not worker.done():
            log.info("stopping at the next safe point")
            halt.set()
            loop_stop.set()
        try:
            try:
                await worker  # re-raises the loop's error
            finally:
                await session.aclose()
        except Exception as exc:
            message = failure_message(exc)
            if dependency_unavailable(exc):  # not the run's fault: exit, be restarted, carry on
                status.update(state="restarting", error=message)
                log.warning(
                    "a service this role needs is unavailable; exiting to be restarted", extra={"error": message}
                )
                raise
            status.update(state="failed", error=message)
            await watch.report_failure(message, config.advertise_host, config.port)
            raise
        status.update(state="finished")
        log.info("step loop finished")
        if not stop.is_set() and not watch.ended:  # done with the run: keep answering health until told to stop
            await asyncio.wait([waiter, follower], return_when=asyncio.FIRST_COMPLETED)
        if watch.ended:
            status.update(state=watch.status)
    finally:
        halt.set()
        loop_stop.set()
        waiter.cancel()
        follower.cancel()
