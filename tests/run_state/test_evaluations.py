"""The eval results store against a real Redis: what the rollout records, any process reads back."""

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from services.run_state.evaluations import Evaluation, EvaluationStore, read_evaluations, read_latest_evaluation
from services.runtime.processes import start_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(log_dir=str(tmp_path_factory.mktemp("redis")))
    yield url
    proc.stop()


def evaluation(version: int, mean_reward: float) -> Evaluation:
    return Evaluation(
        version=version,
        mean_reward=mean_reward,
        pass_at_k=0.25,
        k=4,
        n_prompts=8,
        newest_token_version=version,
        wall_s=1.5,
        finished_at=1_700_000_000.0 + version,
    )


def test_the_latest_evaluation_is_the_newest_versions(redis_url):
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert read_latest_evaluation(client, "eval-test") is None and read_evaluations(client, "eval-test") == []

    async def record():
        client = aioredis.from_url(redis_url, decode_responses=True)
        store = EvaluationStore(client, "eval-test")
        for version, reward in [(10, 0.5), (0, 0.1), (20, 0.7)]:  # out of order: the version decides
            await store.record(evaluation(version, reward))
        await store.record(evaluation(10, 0.55))  # the same version again replaces it
        listed = await store.all()
        await client.aclose()
        return listed

    listed = asyncio.run(record())
    assert [(e.version, e.mean_reward) for e in listed] == [(0, 0.1), (10, 0.55), (20, 0.7)]
    with redis.Redis.from_url(redis_url) as client:  # bytes replies read the same
        assert read_latest_evaluation(client, "eval-test") == evaluation(20, 0.7)
        assert [e.version for e in read_evaluations(client, "eval-test")] == [0, 10, 20]
        assert read_latest_evaluation(client, "other-run") is None
