"""`GET /v1/runs/{run_id}/steps`: the metrics of a run's trained steps, so a follower that has only the
coordinator's URL (`sluice run --attach`) sees the run progress. The records are the trainer's
(services/run_state/trainer_progress.py), read from the Redis the coordinator and the roles share."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query

from services.dcs.models import Ok, StepRecord, StepsPage
from services.dcs.state import RedisState
from services.run_state.trainer_progress import astep_metrics


def steps_router(state: RedisState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/runs/{run_id}/steps", response_model=StepsPage, tags=["runs"], responses={404: {"model": Ok}})
    async def steps(
        run_id: str = Path(pattern=r"^[A-Za-z0-9_.\-]{1,128}$"),
        first: int = Query(0, ge=0),
        limit: int = Query(100, ge=1, le=1000),
    ):
        """Metrics of the steps `first` .. `first + limit - 1` the trainer has recorded."""
        await state.run(run_id)  # 404 for a run that does not exist
        progress, records = await astep_metrics(state.redis, run_id, first, limit)
        return StepsPage(
            next_step=progress.next_step,
            weight_version=progress.version,
            steps=[StepRecord(step=s, metrics=m) for s, m in sorted(records.items())],
        )

    return router
