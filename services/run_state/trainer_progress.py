"""The trainer's progress as other roles see it: the next step it will train and the weight version
it trains that step with. Normally version == next_step; a trainer resumed from a checkpoint older
than the newest published version republishes under a new number, and the rollout's admission
control uses the difference (see services/rollout/admission.py)."""

from __future__ import annotations

import json

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel

from services.run_state import run_key
from services.run_state.prompt_ledger import filtered_groups


class TrainerProgress(BaseModel):
    next_step: int = 0
    version: int = 0

    @property
    def version_offset(self) -> int:
        return self.version - self.next_step


def _key(run_id: str) -> str:
    return run_key(run_id, "trainer", "progress")


def read_progress(client: redis.Redis, run_id: str) -> TrainerProgress:
    text = client.get(_key(run_id))
    return TrainerProgress.model_validate_json(text) if text else TrainerProgress()


async def aread_progress(client: aioredis.Redis, run_id: str) -> TrainerProgress:
    text = await client.get(_key(run_id))
    return TrainerProgress.model_validate_json(text) if text else TrainerProgress()


def write_progress(client: redis.Redis, run_id: str, progress: TrainerProgress) -> None:
    client.set(_key(run_id), progress.model_dump_json())


def finish_step(
    client: redis.Redis, run_id: str, step: int, sample_ids: list[str], metrics: dict, progress: TrainerProgress
) -> None:
    """Step N is done, in one transaction: its audit record (which samples it trained, its metrics) and the
    progress that moves past it. Whoever sees the progress finds the record (and one round trip, not two).
    The groups of the step dynamic sampling dropped (the rollout's count, prompt_ledger.py) join `metrics` as
    `filtered_groups` when there were any: the step's sealed partition means no more will be."""
    if filtered := filtered_groups(client, run_id, step):
        metrics["filtered_groups"] = filtered
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(
            run_key(run_id, "trainer", "steps"), str(step), json.dumps({"samples": sample_ids, "metrics": metrics})
        )
        pipe.set(_key(run_id), progress.model_dump_json())
        pipe.execute()


def trained_steps(client: redis.Redis, run_id: str) -> dict[int, dict]:
    return {int(k): json.loads(v) for k, v in client.hgetall(run_key(run_id, "trainer", "steps")).items()}


def recorded_metrics(client: redis.Redis, run_id: str, steps: range) -> dict[int, dict]:
    """The metrics of the recorded steps among `steps` (sample ids left out): what the trainer reports to the
    coordinator (services/trainer/step_reports.py)."""
    if not steps:
        return {}
    texts = client.hmget(run_key(run_id, "trainer", "steps"), [str(s) for s in steps])
    return {s: json.loads(t)["metrics"] for s, t in zip(steps, texts) if t is not None}
