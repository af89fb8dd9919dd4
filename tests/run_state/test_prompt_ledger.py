import asyncio

import pytest
import redis.asyncio as aioredis

from services.run_state.prompt_ledger import PromptLedger
from services.runtime.processes import start_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(log_dir=str(tmp_path_factory.mktemp("redis")))
    yield url
    proc.stop()


def test_out_of_order_marks_advance_the_frontier_and_count_per_step(redis_url):
    async def run():
        client = aioredis.from_url(redis_url, decode_responses=True)
        ledger = PromptLedger(client, "ledger-test")
        assert await ledger.load() == (0, set())
        assert await ledger.mark_written(2, 1) == 1
        assert await ledger.mark_written(0, 0) == 1
        assert await ledger.load() == (1, {2})
        assert await ledger.mark_written(0, 0) == 1  # a repeat is not counted twice
        assert await ledger.mark_written(1, 0) == 2
        assert await ledger.load() == (3, set())
        # a second ledger object (a restarted rollout) sees the same state
        again = PromptLedger(client, "ledger-test")
        assert await again.load() == (3, set()) and await again.groups_written(1) == 1
        await client.aclose()
    asyncio.run(run())
