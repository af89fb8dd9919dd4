"""`/v1/runs/{run_id}/steps`: the trainer reports its trained steps' metrics (POST) and a follower that has only
the coordinator's URL (`sluice run --attach`, `sluice status`) reads them (GET) to see the run progress. The
coordinator keeps what the trainer reports (step_records.py); it never reads the roles' own keys."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query

from services.dcs.models import Ok, StepsPage, StepsReport
from services.dcs.step_records import StepRecords


def steps_router(records: StepRecords) -> APIRouter:
    router = APIRouter()
    run_id_path = Path(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")

    @router.post("/v1/runs/{run_id}/steps", response_model=Ok, tags=["runs"], responses={404: {"model": Ok}})
    async def report(report: StepsReport, run_id: str = run_id_path):
        """The trainer's progress and the records of the steps it finished since its last acknowledged report."""
        await records.report(run_id, report)
        return Ok(message=f"{len(report.steps)} steps recorded; next step {report.next_step}")

    @router.get("/v1/runs/{run_id}/steps", response_model=StepsPage, tags=["runs"], responses={404: {"model": Ok}})
    async def steps(run_id: str = run_id_path, first: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=1000)):
        """Metrics of the steps `first` .. `first + limit - 1` the trainer has reported."""
        return await records.page(run_id, first, limit)

    return router
