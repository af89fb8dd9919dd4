"""Results of evaluation during training (RunConfig.eval): the rollout scores the held-out prompts at a weight
version and records one Evaluation per version, in Redis under the run (`sluice:<run_id>:eval:results`, a hash
version -> JSON). Any process reads them: `read_evaluations` / `read_latest_evaluation` (blocking client,
the CLI and tracking), `EvaluationStore` (asyncio, the rollout).

    mean_reward = mean of the reward over n_prompts x k samples
    pass_at_k   = (1 / n_prompts) * sum over prompts of [max reward of its k samples >= pass_threshold]"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from services.run_state import run_key


class Evaluation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, description="the weight version the engines served when the eval began")
    mean_reward: float = Field(description="mean reward over every sample")
    pass_at_k: float = Field(ge=0, le=1, description="fraction of prompts with a sample whose reward >= threshold")
    k: int = Field(ge=1, description="samples per prompt")
    n_prompts: int = Field(ge=1, description="held-out prompts evaluated")
    reward_failures: int = Field(0, ge=0, description="samples whose reward failed (scored 0.0)")
    newest_token_version: int = Field(
        ge=0, description="the newest version that produced a token (> version when weights moved during the eval)"
    )
    wall_s: float = Field(ge=0, description="seconds the eval took")
    finished_at: float = Field(description="when it finished, Unix time")


def _key(run_id: str) -> str:
    return run_key(run_id, "eval", "results")


def _parse(values) -> list[Evaluation]:
    return sorted((Evaluation.model_validate_json(v) for v in values), key=lambda e: e.version)


def read_evaluations(client: redis.Redis, run_id: str) -> list[Evaluation]:
    """Every evaluation of the run, oldest version first."""
    return _parse(client.hvals(_key(run_id)))


def read_latest_evaluation(client: redis.Redis, run_id: str) -> Evaluation | None:
    """The evaluation of the newest version, or None before the first one."""
    evaluations = read_evaluations(client, run_id)
    return evaluations[-1] if evaluations else None


class EvaluationStore:
    """The rollout's end: records evaluations and lists them (to know which versions are done after a restart)."""

    def __init__(self, client: aioredis.Redis, run_id: str):
        self.client = client
        self.key = _key(run_id)

    async def record(self, evaluation: Evaluation) -> None:
        await self.client.hset(self.key, str(evaluation.version), evaluation.model_dump_json())

    async def all(self) -> list[Evaluation]:
        return _parse(await self.client.hvals(self.key))
