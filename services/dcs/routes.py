"""The coordinator's routes, one router per resource. Routes are thin: validation is in the models, state
in Redis (state.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.dcs import lifecycle
from services.dcs.config import DCSConfig
from services.dcs.engine_set import EngineSets
from services.dcs.models import (
    Cursors,
    CursorUpdate,
    FailureReport,
    Heartbeat,
    HeartbeatReply,
    NodeInfo,
    NodeRegistration,
    Ok,
    PublishedWeights,
    Run,
    RunConfig,
    RunStatus,
    ServiceStatus,
    SyncGroup,
    SyncGroupRequest,
    SyncReport,
    Topology,
    WeightMetadata,
)
from services.dcs.state import Missing, RedisState
from services.dcs.sync_groups import SyncGroups
from services.runtime.redis_events import RedisEvents

log = logging.getLogger(__name__)

SYNC_SECONDS = Histogram("sluice_dcs_sync_phase_seconds", "reported weight-sync phase times", ["phase"])
SYNC_BYTES = Counter("sluice_dcs_sync_bytes_total", "bytes moved by reported weight syncs")
SYNC_FAILURES = Counter("sluice_dcs_sync_failures_total", "weight syncs reported as failed")
LATEST_VERSION = Gauge("sluice_dcs_latest_weight_version", "newest published weight version", ["run"])


def _name():
    """A path parameter holding a node id or run name (a fresh FieldInfo per use)."""
    return Path(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")


def health_router(state: RedisState) -> APIRouter:
    """Health and metrics."""
    router = APIRouter()

    @router.get("/healthz", response_model=Ok, tags=["health"])
    async def healthz():
        return Ok(message="alive")

    @router.get("/readyz", response_model=Ok, tags=["health"], responses={503: {"model": Ok}})
    async def readyz():
        try:
            await state.redis.ping()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            return JSONResponse(Ok(ok=False, message=f"redis: {exc}").model_dump(), status_code=503)
        return Ok(message="ready")

    @router.get("/metrics", tags=["health"], response_class=Response)
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return router


def node_router(config: DCSConfig, state: RedisState, engines: EngineSets) -> APIRouter:
    """Registration, heartbeats, topology."""
    router = APIRouter()

    @router.post("/v1/nodes", response_model=NodeInfo, status_code=201, tags=["nodes"], responses={409: {"model": Ok}})
    async def register(reg: NodeRegistration):
        await engines.refuse_removed(reg)  # an engine taken out of its run stays out
        node = await state.register(reg)
        log.info("node registered", extra={"node_id": node.node_id, "role": node.role, "rank": node.rank})
        return node

    @router.post(
        "/v1/nodes/{node_id}/heartbeat",
        response_model=HeartbeatReply,
        tags=["nodes"],
        responses={
            404: {"model": Ok},
            409: {
                "model": Ok,
                "description": "an engine's heartbeat with a "
                "weight_version (the coordinator records engines' versions)",
            },
        },
    )
    async def heartbeat(hb: Heartbeat, node_id: str = _name()):
        node = await state.heartbeat(node_id, hb)
        try:
            run = await state.run(node.run_id)
            desired, seq, lifecycle = run.desired_state, run.pause_seq, run.status
        except Missing:
            desired, seq, lifecycle = "running", 0, "running"
        return HeartbeatReply(desired_state=desired, pause_seq=seq, lease_s=config.node_lease_s, status=lifecycle)

    @router.delete("/v1/nodes/{node_id}", response_model=Ok, tags=["nodes"])
    async def unregister(node_id: str = _name()):
        return Ok(ok=await state.unregister(node_id))

    @router.get("/v1/nodes/{node_id}", response_model=NodeInfo, tags=["nodes"], responses={404: {"model": Ok}})
    async def node(node_id: str = _name()):
        return await state.node(node_id)

    @router.get("/v1/topology", response_model=Topology, tags=["nodes"])
    async def topology():
        roles: dict[str, list[NodeInfo]] = {}
        for n in await state.nodes():
            roles.setdefault(n.role, []).append(n)
        return Topology(roles=roles)

    return router


def _run_id():
    """The run a weight, cursor, group or sync route is scoped to."""
    return Path(pattern=r"^[A-Za-z0-9_.\-]{1,128}$", description="the run id (RunConfig.name)")


def weight_router(config: DCSConfig, state: RedisState, events: RedisEvents) -> APIRouter:
    """A run's weight versions and receiver cursors: everything under /v1/runs/{run_id}/."""
    router = APIRouter(prefix="/v1/runs/{run_id}")

    @router.post(
        "/weights", response_model=PublishedWeights, status_code=201, tags=["weights"], responses={409: {"model": Ok}}
    )
    async def publish(meta: WeightMetadata, run_id: str = _run_id()):
        published = await state.publish(run_id, meta)
        LATEST_VERSION.labels(run_id).set(meta.version)
        return published

    @router.get("/weights/latest", response_model=PublishedWeights, tags=["weights"], responses={404: {"model": Ok}})
    async def latest(run_id: str = _run_id()):
        version = await state.latest_version(run_id)
        if version == 0:
            raise Missing(f"run {run_id} has no weights published yet")
        return await state.weights(run_id, version)

    @router.get(
        "/weights/next",
        response_model=PublishedWeights,
        tags=["weights"],
        responses={204: {"description": "nothing newer by the deadline"}},
    )
    async def next_version(
        run_id: str = _run_id(), after: int = Query(0, ge=0), wait_s: float = Query(0.0, ge=0, le=3600)
    ):
        """Long-poll: the run's latest version newer than `after`, waiting up to `wait_s` for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, config.max_wait_s)
        while True:
            event = events.waiter(state.weights_topic(run_id))
            version = await state.latest_version(run_id)
            if version > after:
                return await state.weights(run_id, version)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return Response(status_code=204)
            try:
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 2.0))
            except TimeoutError:
                pass

    @router.get("/weights/{version}", response_model=PublishedWeights, tags=["weights"], responses={404: {"model": Ok}})
    async def weights(version: int, run_id: str = _run_id()):
        return await state.weights(run_id, version)

    @router.put("/cursors/{role}", response_model=Cursors, tags=["weights"], responses={409: {"model": Ok}})
    async def set_cursor(update: CursorUpdate, run_id: str = _run_id(), role: str = Path(pattern=r"^[a-z_]{1,32}$")):
        return Cursors(cursors=await state.set_cursor(run_id, role, update.version))

    @router.get("/cursors", response_model=Cursors, tags=["weights"])
    async def cursors(run_id: str = _run_id()):
        return Cursors(cursors=await state.cursors(run_id))

    return router


def sync_router(groups: SyncGroups) -> APIRouter:
    """A run's sync group and sync reports."""
    router = APIRouter(prefix="/v1/runs/{run_id}")

    @router.post(
        "/sync-group", response_model=SyncGroup, tags=["sync"], responses={404: {"model": Ok}, 409: {"model": Ok}}
    )
    async def sync_group(req: SyncGroupRequest, run_id: str = _run_id()):
        """The broadcast group for the source's live receivers of this run (same membership, same group)."""
        return await groups.sync_group(run_id, req)

    @router.get("/sync-group", response_model=SyncGroup, tags=["sync"], responses={404: {"model": Ok}})
    async def current_group(run_id: str = _run_id()):
        return await groups.current_group(run_id)

    @router.post("/syncs", response_model=Ok, tags=["sync"])
    async def report_sync(report: SyncReport, run_id: str = _run_id()):
        await groups.report_sync(run_id, report)
        for phase, seconds in report.seconds.items():
            SYNC_SECONDS.labels(phase).observe(seconds)
        SYNC_BYTES.inc(report.bytes)
        if not report.ok:
            SYNC_FAILURES.inc()
            log.warning(
                "sync failed",
                extra={"run_id": run_id, "version": report.version, "node_id": report.node_id, "error": report.error},
            )
        return Ok()

    @router.get("/syncs", response_model=list[SyncReport], tags=["sync"])
    async def sync_reports(run_id: str = _run_id(), limit: int = Query(50, ge=1, le=1000)):
        return await groups.sync_reports(run_id, limit)

    return router


def run_router(state: RedisState) -> APIRouter:
    """Runs: create, list, read, status."""
    router = APIRouter()

    @router.post("/v1/runs", response_model=Run, status_code=201, tags=["runs"], responses={409: {"model": Ok}})
    async def create_run(run_config: RunConfig):
        return await state.create_run(run_config)

    @router.get("/v1/runs", response_model=list[Run], tags=["runs"])
    async def runs():
        return await state.runs()

    @router.get("/v1/runs/{run_id}", response_model=Run, tags=["runs"], responses={404: {"model": Ok}})
    async def run(run_id: str = _name()):
        return await state.run(run_id)

    @router.delete(
        "/v1/runs/{run_id}",
        response_model=Ok,
        tags=["runs"],
        responses={
            404: {"model": Ok},
            409: {"model": Ok, "description": "the run is running or paused: stop it first"},
        },
    )
    async def delete_run(run_id: str = _name()):
        """Forget an ended (failed, finished or stopped) run and all state kept for it; its id is free again."""
        deleted = await state.delete_run(run_id)
        log.info("run deleted", extra={"run_id": run_id, "keys": deleted})
        return Ok(message=f"run {run_id} deleted ({deleted} keys)")

    @router.get("/v1/runs/{run_id}/status", response_model=RunStatus, tags=["runs"], responses={404: {"model": Ok}})
    async def status(run_id: str = _name()):
        return await run_status(state, run_id)

    return router


def lifecycle_router(state: RedisState) -> APIRouter:
    """A run's lifecycle: pause, resume, fail, stop, finish (the rules: lifecycle.py)."""
    router = APIRouter()
    refusals: dict[int | str, dict[str, Any]] = {
        404: {"model": Ok},
        409: {"model": Ok, "description": "the run is failed, finished or stopped"},
    }

    @router.post("/v1/runs/{run_id}/pause", response_model=Run, tags=["runs"], responses=refusals)
    async def pause(run_id: str = _name()):
        """Ask every service of the run to pause at its next safe point (they acknowledge by heartbeat)."""
        return await lifecycle.set_desired(state, run_id, "paused")

    @router.post("/v1/runs/{run_id}/resume", response_model=Run, tags=["runs"], responses=refusals)
    async def resume(run_id: str = _name()):
        return await lifecycle.set_desired(state, run_id, "running")

    @router.post("/v1/runs/{run_id}/fail", response_model=Run, tags=["runs"], responses=refusals)
    async def fail(report: FailureReport, run_id: str = _name()):
        """A role reports a fatal error before it exits: the run becomes failed (the first report wins;
        later ones are listed on /status) and every other role exits at its next safe point."""
        log.error(
            "run failed",
            extra={"run_id": run_id, "role": report.role, "node_id": report.node_id, "error": report.message},
        )
        return await lifecycle.fail(state, run_id, report)

    @router.post("/v1/runs/{run_id}/stop", response_model=Run, tags=["runs"], responses=refusals)
    async def stop(run_id: str = _name()):
        """Stop the run: every role exits cleanly at its next safe point. A stopped run stays stopped."""
        return await lifecycle.end(state, run_id, "stopped")

    @router.post("/v1/runs/{run_id}/finish", response_model=Run, tags=["runs"], responses=refusals)
    async def finish(run_id: str = _name()):
        """The trainer trained the run's num_steps."""
        return await lifecycle.end(state, run_id, "finished")

    return router


async def run_status(state: RedisState, run_id: str) -> RunStatus:
    """The run, its lifecycle and each of its nodes' state (pausing until it acknowledged a pause)."""
    run = await state.run(run_id)
    services = []
    for n in await state.nodes():
        if n.run_id != run_id:
            continue
        acked = run.desired_state == "paused" and n.paused_seq >= run.pause_seq
        if not n.alive:
            node_state = "dead"
        elif run.desired_state == "paused":
            node_state = "paused" if acked else "pausing"
        else:
            node_state = "running"
        services.append(
            ServiceStatus(
                node_id=n.node_id,
                role=n.role,
                rank=n.rank,
                state=node_state,
                step=n.step,
                weight_version=n.weight_version,
                last_heartbeat=n.last_heartbeat,
                pause_acknowledged=acked,
                url=n.url(),
            )
        )
    return RunStatus(
        run=run,
        status=run.status,
        failure=run.failure,
        later_failures=await state.later_failures(run_id) if run.status == "failed" else [],
        latest_weight_version=await state.latest_version(run_id),
        services=services,
    )
