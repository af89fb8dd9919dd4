"""A run's engines over REST (engine_set.py): list, add (an SGLang server, or any engine that does not register
itself), remove (drained by the rollout: its requests go to the other engines)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Path, Query

from services.dcs.engine_set import EngineSets
from services.dcs.models import EngineAdd, EngineEntry, EngineList, Ok
from services.dcs.state import Conflict

log = logging.getLogger(__name__)


def engine_router(engines: EngineSets) -> APIRouter:
    router = APIRouter()
    run_id_path = Path(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    refusals: dict[int | str, dict[str, Any]] = {404: {"model": Ok}, 409: {"model": Ok}}

    @router.get(
        "/v1/runs/{run_id}/engines", response_model=EngineList, tags=["engines"], responses={404: {"model": Ok}}
    )
    async def listing(run_id: str = run_id_path):
        return await engines.listing(run_id)

    @router.post(
        "/v1/runs/{run_id}/engines", response_model=EngineEntry, status_code=201, tags=["engines"], responses=refusals
    )
    async def add(body: EngineAdd, run_id: str = run_id_path):
        """Add an engine to the run: the rollout registers it, the trainer sends it the current weights, and
        it gets requests once it serves them. Adding one that is there already changes nothing."""
        entry = await engines.add(run_id, body)
        if entry is None:
            raise Conflict(
                f"engine {body.url} was removed from run {run_id}: the rollout's --engine-url does not "
                "bring it back (add it without `initial` to)"
            )
        log.info("engine added", extra={"run_id": run_id, "engine": entry.url, "rank": entry.rank})
        return entry

    @router.delete("/v1/runs/{run_id}/engines", response_model=Ok, tags=["engines"], responses=refusals)
    async def remove(
        run_id: str = run_id_path, url: str = Query(min_length=1, max_length=512, description="the engine's base URL")
    ):
        """Take an engine out of the run: the rollout stops sending it requests and resubmits the ones it holds
        elsewhere; it cannot register for the run again until added again."""
        try:
            node_ids = await engines.remove(run_id, url)
        except ValueError as exc:  # not an engine URL
            raise HTTPException(422, str(exc)) from None
        log.info("engine removed", extra={"run_id": run_id, "engine": url, "registrations": len(node_ids)})
        return Ok(message=f"removed {url} ({len(node_ids)} registration(s) dropped)")

    return router
