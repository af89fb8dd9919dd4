"""Reward per data source: the rollout adds each written group's rewards under its step and the row's source
(rollout.source_field); rows without the field add nothing. The Redis store and its reader against a real
redis-server (the trainer's tracking reads a step's means: reward_by_source/<source>)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
import redis
import redis.asyncio as aioredis

from services.run_state.source_rewards import MAX_SOURCE_CHARS, SourceRewards, read_source_rewards
from services.runtime.processes import start_redis
from tests.rollout.rollout_harness import N, PROMPTS, Rollout, make_run


class RecordedSources:
    def __init__(self):
        self.added = defaultdict(list)  # (step, source) -> rewards

    async def add(self, step: int, source: str, rewards: list[float]) -> None:
        self.added[(step, source)].extend(rewards)


def test_the_rollout_adds_each_groups_rewards_under_its_step_and_source(model_dir, tmp_path):
    path = tmp_path / "mixed.jsonl"  # row i has label i; rows 0 and 2 say where they come from, row 1 does not
    rows = [{"prompt": p, "label": i, **({"origin": f"set-{i % 2}"} if i != 1 else {})} for i, p in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = RecordedSources()
    run = make_run(model_dir, str(path))
    run = run.model_copy(update={"rollout": run.rollout.model_copy(update={"source_field": "origin"})})
    r = Rollout(run, source_rewards=sources).go()

    groups = r.run.num_steps * r.run.rollout_batch_size  # positions 0.. in file order: row = position % 3
    assert sum(len(v) for v in sources.added.values()) == N * sum(1 for p in range(groups) if p % 3 != 1)
    for (step, source), rewards in sources.added.items():
        assert source in ("set-0",) and len(rewards) % N == 0  # rows 0 and 2 are set-0; row 1 adds nothing
        assert all(int(x) in (0, 2) for x in rewards)  # the reward is the label plus len(text) / 1000
        assert 0 <= step < r.run.num_steps


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(log_dir=str(tmp_path_factory.mktemp("redis")))
    yield url
    proc.stop()


def test_a_steps_means_per_source_read_back(redis_url):
    async def write():
        client = aioredis.from_url(redis_url, decode_responses=True)
        store = SourceRewards(client, "src-test")
        await store.add(3, "math", [1.0, 0.0])
        await store.add(3, "math", [1.0, 1.0])
        await store.add(3, "code:python", [0.5, 0.5])  # a ':' in the source name is kept
        await store.add(4, "x" * 500, [0.25])
        await client.aclose()

    asyncio.run(write())
    with redis.Redis.from_url(redis_url) as client:  # bytes replies read the same
        assert read_source_rewards(client, "src-test", 3) == {"code:python": 0.5, "math": 0.75}
        assert read_source_rewards(client, "src-test", 4) == {"x" * MAX_SOURCE_CHARS: 0.25}
        assert read_source_rewards(client, "src-test", 5) == {} and read_source_rewards(client, "other", 3) == {}
        assert 0 < client.ttl("sluice:src-test:step:3:source_rewards") <= 86_400
