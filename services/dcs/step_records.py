"""A run's trained steps, as the trainer reports them (`POST /v1/runs/<run>/steps`, services/trainer/step_reports.py)
and a follower reads them (`GET /v1/runs/<run>/steps`: `sluice run`, `sluice status`). The coordinator's own keys,
under its run key, so they go with the run when it is deleted:

  K:run:R:steps     HASH   step -> the step's metrics (JSON)
  K:run:R:progress  STRING the trainer's progress as last reported: {"next_step", "weight_version"}
"""

from __future__ import annotations

import json

from services.dcs.models import StepRecord, StepsPage, StepsReport
from services.dcs.state import Missing, RedisState

# The report of a run that exists only (one deleted meanwhile gets no keys back), records and progress together.
_REPORT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""


class StepRecords:
    def __init__(self, state: RedisState):
        self.state = state
        self._report = state.redis.register_script(_REPORT)

    def _keys(self, run_id: str) -> tuple[str, str]:
        run_key = self.state.run_key(run_id)
        return f"{run_key}:steps", f"{run_key}:progress"

    async def report(self, run_id: str, report: StepsReport) -> None:
        """Keep the reported records (a step reported again replaces its record) and the progress, in one script.
        Metrics are kept as JSON (a NaN or infinity in them reads back as null)."""
        steps, progress = self._keys(run_id)
        records: list[str] = []  # step, metrics, step, metrics, ...
        for record in report.steps:
            records += [str(record.step), json.dumps(record.model_dump(mode="json")["metrics"])]
        reported = json.dumps({"next_step": report.next_step, "weight_version": report.weight_version})
        if not await self._report(keys=[f"{self.state.k}:runs", steps, progress], args=[run_id, reported, *records]):
            raise Missing(f"run {run_id} does not exist")

    async def page(self, run_id: str, first: int, limit: int) -> StepsPage:
        """The trainer's progress and the records of steps first .. first+limit-1 that it reported and finished
        (a resumed run on a new Redis has no records of the steps before its checkpoint)."""
        await self.state.run(run_id)  # 404 for a run that does not exist
        steps, progress = self._keys(run_id)
        text = await self.state.redis.get(progress)
        reported = json.loads(text) if text else {"next_step": 0, "weight_version": 0}
        wanted = [str(s) for s in range(first, min(reported["next_step"], first + limit))]
        texts = await self.state.redis.hmget(steps, wanted) if wanted else []
        return StepsPage(
            next_step=reported["next_step"],
            weight_version=reported["weight_version"],
            steps=[StepRecord(step=int(s), metrics=json.loads(t)) for s, t in zip(wanted, texts) if t is not None],
        )
