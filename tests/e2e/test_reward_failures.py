"""A whole run (every service its own process) whose reward raises on some prompts, with reward_fallback
skip_group and eval during training: it finishes, every sample is trained exactly once or its group recorded as
skipped, the failures are on the rollout's /metrics, and the evaluations are in Redis for any process."""

from __future__ import annotations

import time

import httpx
import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.prompt_source import open_prompt_source
from services.run_contract.run_config import RunConfig
from services.run_state.evaluations import read_evaluations, read_latest_evaluation
from services.run_state.prompt_ledger import skipped_prompts
from tests.conftest import metric_value
from tests.e2e.failing_rewards import fails
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_reward_that_raises_on_some_prompts_skips_their_groups_and_the_run_finishes(tmp_path, fork_server):
    model_dir = init_model(str(tmp_path / "tiny"), preset="tiny", arch="qwen2", seed=7)
    run = RunConfig(
        name="flaky-reward",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        global_batch_size=8,
        micro_batch_size=4,
        num_steps=3,
        rollout={
            "prompts": "demo:letters",
            "reward": "import:tests.e2e.failing_rewards:letters_unless_a",
            "reward_fallback": "skip_group",
            "max_new_tokens": 8,
        },
        eval={"prompts": "demo:letters", "every_n_versions": 2, "max_prompts": 4, "max_new_tokens": 8},
        optim={"lr": 1e-4},
    )
    source = open_prompt_source("demo:letters")
    with LocalRun(run, log_dir=str(tmp_path / "logs"), forker=fork_server) as lr:
        lr.wait_for_step(run.num_steps, 400)
        assert_run_complete(lr, run)  # exactly once, counting the skipped groups' prompts
        # the rollout evaluates the last version once it sees the trainer finish, then says finished
        deadline = time.monotonic() + 120
        while httpx.get(lr.procs["rollout"].status_url + "/status").json()["state"] != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with lr.redis_client() as r:
            skipped = skipped_prompts(r, run.name)
            latest = read_latest_evaluation(r, run.name)
            evaluations = read_evaluations(r, run.name)
        assert skipped and all(fails(source.record(p).fields) and "LookupError" in why for p, why in skipped.items())
        metrics = httpx.get(lr.procs["rollout"].status_url + "/metrics").text
        assert metric_value(metrics, "sluice_rollout_reward_failures_total", reason="exception") == 2 * len(skipped)
        assert metric_value(metrics, "sluice_rollout_skipped_groups_total") == len(skipped)
        # the baseline, and the last version once the rollout saw the trainer finish
        assert evaluations[0].version == 0 and latest.version == run.num_steps
        assert all(e.n_prompts == 4 and e.k == 1 for e in evaluations)


def test_dynamic_sampling_drops_groups_without_variance_and_every_sample_is_trained_once(tmp_path, fork_server):
    model_dir = init_model(str(tmp_path / "tiny"), preset="tiny", arch="qwen2", seed=7)
    run = RunConfig(
        name="filtered",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        global_batch_size=8,
        micro_batch_size=4,
        num_steps=3,
        rollout={
            "prompts": "demo:letters",
            "reward": "import:tests.e2e.failing_rewards:flat_when_a",
            "filter_groups": "zero_variance",
            "max_new_tokens": 8,
        },
        # a prompt's samples all cut at 8 tokens lose the same: its group keeps its (zero) variance
        reward_shaping={"overlong": {"buffer": 4, "penalty": 0.5}},
        optim={"lr": 1e-4},
    )
    source = open_prompt_source("demo:letters")
    with LocalRun(run, log_dir=str(tmp_path / "logs"), forker=fork_server) as lr:
        lr.wait_for_step(run.num_steps, 400)
        steps = assert_run_complete(lr, run)  # exactly once: a filtered prompt counts as consumed, never trained
        with lr.redis_client() as r:
            dropped = skipped_prompts(r, run.name)
    assert dropped and all(why.startswith("filter_groups zero_variance") for why in dropped.values())
    assert {p for p in range(max(dropped) + 1) if fails(source.record(p).fields)} <= set(dropped)
    assert sum(rec["metrics"].get("filtered_groups", 0) for rec in steps.values()) == len(dropped)
