import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from services.run_state.prompt_ledger import PromptLedger, filtered_groups, skipped_prompts
from services.run_state.trainer_progress import TrainerProgress, finish_step, trained_steps
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


def test_a_skipped_group_gives_its_slot_the_next_spare_prompt_once(redis_url):
    async def run():
        client = aioredis.from_url(redis_url, decode_responses=True)
        ledger = PromptLedger(client, "skip-test")
        assert await ledger.replacements() == {}
        assert await ledger.skip(3, 3, "KeyError: 'answer'", first_spare=8) == 8
        assert await ledger.skip(3, 3, "again", first_spare=8) == 8  # a repeat allocates nothing
        assert await ledger.skip(3, 8, "ValueError", first_spare=8) == 9  # the spare failed too
        assert await ledger.skip(5, 5, "x" * 2000, first_spare=8) == 10
        assert await PromptLedger(client, "skip-test").replacements() == {3: 9, 5: 10}
        await client.aclose()

    asyncio.run(run())
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        skipped = skipped_prompts(client, "skip-test")
    assert sorted(skipped) == [3, 5, 8] and skipped[3] == "KeyError: 'answer'" and len(skipped[5]) == 500


def test_groups_dynamic_sampling_drops_are_counted_for_their_step_once_and_join_its_record(redis_url):
    async def run():
        client = aioredis.from_url(redis_url, decode_responses=True)
        ledger = PromptLedger(client, "filter-test")
        assert await ledger.skip(0, 0, "filter_groups zero_variance", first_spare=4, filtered_step=0) == 4
        assert await ledger.skip(0, 0, "again", first_spare=4, filtered_step=0) == 4  # a repeat: not counted
        assert await ledger.skip(0, 4, "filter_groups zero_variance", first_spare=4, filtered_step=0) == 5
        assert await ledger.skip(2, 2, "KeyError", first_spare=4) == 6  # the reward failed: not a filter's drop
        assert (await ledger.filtered(0), await ledger.filtered(1)) == (2, 0)
        await client.aclose()

    asyncio.run(run())
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert filtered_groups(client, "filter-test", 0) == 2
        metrics = {"loss": 0.5}
        finish_step(client, "filter-test", 0, ["0:0"], metrics, TrainerProgress(next_step=1, version=1))
        assert trained_steps(client, "filter-test")[0]["metrics"] == {"loss": 0.5, "filtered_groups": 2}
        metrics = {"loss": 0.4}  # a step with nothing filtered has no such metric
        finish_step(client, "filter-test", 1, ["4:0"], metrics, TrainerProgress(next_step=2, version=2))
        assert trained_steps(client, "filter-test")[1]["metrics"] == {"loss": 0.4}
