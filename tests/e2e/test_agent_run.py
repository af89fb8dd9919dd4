"""A fully-async run whose rollout plays each sample as an agent episode (demo:tool and its agent,
services/demo_tasks/tool_agent.py, plain `openai` client code talking to the rollout's per-episode endpoint):
every service its own process, weights published while episodes run; every episode trained exactly once. Each
episode is written as rollout.agent_chains = 2 rows (its one chain and a copy that trains on nothing), so the
advantage role's per-episode statistics and the trainer's loss totals run on groups of 2 x n rows."""

from __future__ import annotations

import httpx
import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_agent_episodes_train_exactly_once(tmp_path, fork_server):
    model_dir = init_model(str(tmp_path / "tiny"), preset="tiny", arch="qwen2", seed=7)
    run = RunConfig(
        name="agents",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=8,
        micro_batch_size=2,
        num_steps=4,
        rollout={"prompts": "demo:tool", "agent": "import:services.demo_tasks.tool_agent:solve", "agent_chains": 2},
        optim={"lr": 1e-4},
    )
    with LocalRun(run, log_dir=str(tmp_path / "logs"), forker=fork_server) as lr:
        lr.wait_for_step(run.num_steps, 400)
        steps = assert_run_complete(lr, run)
        metrics = httpx.get(lr.service_urls()["rollout"] + "/metrics").text
    done = [
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith('sluice_rollout_agent_episodes_total{outcome="done"}')
    ]
    assert done and done[0] >= run.num_steps * run.rollout_batch_size * run.n_samples_per_prompt, metrics[-2000:]
    assert all(rec["metrics"]["tokens"] > 0 for rec in steps.values())
