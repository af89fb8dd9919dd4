"""Evaluation during training (services/rollout/evaluation.py) against the in-memory fakes: which versions are
evaluated, what is recorded, that eval samples never reach TransferQueue, and that a failed eval is tried again."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.rollout.engine_pool import EnginePool
from services.rollout.evaluation import Evaluator
from services.rollout.rewards import build_reward
from services.run_contract.run_config import RunConfig
from tests.fakes import FakeEngines, InMemoryEvaluations
from tests.rollout.rollout_harness import N, Rollout, make_run

EVAL_PROMPTS = [("What is 3 + 4?", 10), ("Name a fruit.", 20)]  # (prompt, label)


@pytest.fixture
def eval_prompts(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": label}) + "\n" for p, label in EVAL_PROMPTS))
    return str(path)


def eval_run(model_dir, prompts, eval_prompts, num_steps: int = 4, **eval_settings) -> RunConfig:
    run = make_run(model_dir, prompts, num_steps=num_steps, max_staleness=1)
    settings = {"prompts": eval_prompts, "every_n_versions": 2, "n_samples": 3, "pass_threshold": 15.0, **eval_settings}
    return RunConfig.model_validate({**run.model_dump(), "eval": settings})


def evaluator(run: RunConfig, engines: FakeEngines, store: InMemoryEvaluations, tokenizer) -> Evaluator:
    pool = EnginePool(["http://engine-0:1"], client=engines.client)
    return Evaluator(
        run,
        pool,
        build_reward(run.rollout.reward),
        store,
        lambda prompt: tokenizer.encode(prompt, add_special_tokens=False),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        lambda: False,
    )


def test_a_run_with_eval_records_the_baseline_and_the_last_version(model_dir, prompts, eval_prompts):
    store = InMemoryEvaluations()
    r = Rollout(eval_run(model_dir, prompts, eval_prompts), evaluations=store).go()

    versions = sorted(store.recorded)
    assert versions[0] == 0 and versions[-1] == 4  # the baseline and the run's last version
    for version in versions:
        e = store.recorded[version]
        assert (e.version, e.k, e.n_prompts, e.reward_failures) == (version, 3, 2, 0)
        assert e.pass_at_k == 0.5  # label 20 passes the threshold of 15, label 10 never does
        assert 15 < e.mean_reward < 15.1  # labels 10 and 20, plus len(response) / 1000
    # eval samples never entered the data plane: only the run's 8 training groups are there
    assert sorted(r.groups()) == list(range(8)) and sum(len(rows) for rows in r.groups().values()) == 8 * N
    # each eval is one batch request: both prompts (eval.concurrency 32), 3 samples each
    eval_requests = [q for q in r.engines.requests if "-eval" in q.rids[0]]
    assert len(eval_requests) == len(versions) and all(len(q.rids) == 6 for q in eval_requests)


def test_eval_concurrency_bounds_the_prompts_of_one_request(model_dir, prompts, eval_prompts):
    store = InMemoryEvaluations()
    r = Rollout(eval_run(model_dir, prompts, eval_prompts, concurrency=1), evaluations=store).go()
    eval_requests = [q for q in r.engines.requests if "-eval" in q.rids[0]]
    assert len(eval_requests) == 2 * len(store.recorded) and all(len(q.rids) == 3 for q in eval_requests)
    assert all(e.pass_at_k == 0.5 and e.n_prompts == 2 for e in store.recorded.values())


def test_due_versions_are_the_baseline_and_each_multiple_once(model_dir, prompts, eval_prompts, tokenizer):
    run = eval_run(model_dir, prompts, eval_prompts, every_n_versions=10)
    e = evaluator(run, FakeEngines(), InMemoryEvaluations(), tokenizer)
    assert e.due(0) and e.due(3)  # nothing evaluated yet: the baseline, whatever the version
    e.done = {0}
    assert not e.due(0) and not e.due(9) and e.due(10) and e.due(13)  # versions may jump past a multiple
    e.done = {0, 13}
    assert not e.due(19) and e.due(20) and e.due(31)


def test_a_greedy_eval_of_the_same_weights_gives_the_same_result(model_dir, prompts, eval_prompts, tokenizer):
    run = eval_run(model_dir, prompts, eval_prompts, temperature=0.0)
    engines, store = FakeEngines(), InMemoryEvaluations()
    e = evaluator(run, engines, store, tokenizer)

    async def twice():
        return await e.evaluate(0), await e.evaluate(0)

    first, second = asyncio.run(twice())
    assert (first.mean_reward, first.pass_at_k) == (second.mean_reward, second.pass_at_k)
    half = len(engines.requests) // 2
    assert [q.inputs for q in engines.requests[:half]] == [q.inputs for q in engines.requests[half:]]


def test_a_failed_eval_is_tried_again_when_the_version_moves(model_dir, prompts, eval_prompts, tokenizer):
    run = eval_run(model_dir, prompts, eval_prompts)
    engines, store = FakeEngines(), InMemoryEvaluations()
    store.fail_next = 1
    e = evaluator(run, engines, store, tokenizer)

    async def scenario():
        watcher = asyncio.create_task(e.engines.watch_versions(1.0, 0.01, lambda: None))
        loop = asyncio.create_task(e.run_loop(0.01))
        while len(engines.requests) < 1:  # the baseline at version 0 generated (and then failed to record)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert store.recorded == {} and not loop.done()  # not fatal, and not retried at the same version
        engines.set_version(1)
        while not store.recorded:
            await asyncio.sleep(0.01)
        loop.cancel()
        watcher.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert list(store.recorded) == [1]


class UnreadableEvaluations(InMemoryEvaluations):
    async def all(self) -> list:
        raise ConnectionError("redis went away")


def test_evaluations_that_cannot_be_read_back_do_not_stop_the_eval(model_dir, prompts, eval_prompts, tokenizer):
    engines, store = FakeEngines(), UnreadableEvaluations()
    e = evaluator(eval_run(model_dir, prompts, eval_prompts), engines, store, tokenizer)

    async def scenario():
        loop = asyncio.create_task(e.run_loop(0.01))
        while not store.recorded:
            assert not loop.done()
            await asyncio.sleep(0.01)
        loop.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert list(store.recorded) == [0]
