"""Reward per data source of each step (RolloutSettings.source_field, e.g. a mixed dataset's `data_source`): the
rollout adds each written group's rewards under its step and source, the trainer's tracking reads a step's
means when it records the step (`reward_by_source/<source>`).

    reward_by_source[s] = (sum of the rewards of the step's samples from source s) / (their count)

Redis hash `sluice:<run_id>:step:<N>:source_rewards`, fields `<source>:sum` and `<source>:count`, expiring after
a day (tracking reads it seconds after the step). A group written again after a rollout restart is counted
again: the means are for watching a run, never an input to training. Sources longer than MAX_SOURCE_CHARS are
cut; a step keeps at most MAX_SOURCES sources (more are dropped and logged once)."""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aioredis

from services.run_state import run_key

TTL_S = 86_400
MAX_SOURCE_CHARS = 64
MAX_SOURCES = 64
log = logging.getLogger(__name__)


def _key(run_id: str, step: int) -> str:
    return run_key(run_id, "step", str(step), "source_rewards")


class SourceRewards:
    """The rollout's writer (asyncio Redis)."""

    def __init__(self, client: aioredis.Redis, run_id: str):
        self.client, self.run_id = client, run_id
        self._warned = False

    async def add(self, step: int, source: str, rewards: list[float]) -> None:
        source = str(source)[:MAX_SOURCE_CHARS]
        key = _key(self.run_id, step)
        if await self.client.hlen(key) >= 2 * MAX_SOURCES and not await self.client.hexists(key, f"{source}:count"):
            if not self._warned:
                self._warned = True
                log.warning(
                    "too many data sources in one step; the rest are not tracked",
                    extra={"step": step, "max_sources": MAX_SOURCES},
                )
            return
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrbyfloat(key, f"{source}:sum", float(sum(rewards)))
        pipe.hincrby(key, f"{source}:count", len(rewards))
        pipe.expire(key, TTL_S)
        await pipe.execute()


def read_source_rewards(client: redis.Redis, run_id: str, step: int) -> dict[str, float]:
    """{source: mean reward} of step N's samples that named a source; {} when none did."""
    fields = client.hgetall(_key(run_id, step))
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for name, value in fields.items():
        name = name.decode() if isinstance(name, bytes) else name
        source, _, kind = name.rpartition(":")
        (sums if kind == "sum" else counts)[source] = float(value)
    return {s: sums[s] / counts[s] for s in sorted(sums) if counts.get(s)}
