"""A trainer stopped with SIGTERM exits 0 after checkpointing its last finished step (no checkpoint interval
set), and a trainer started again resumes right after that step: every sample trained exactly once, no step
lost. The finished run leaves a final checkpoint that `sluice export` turns into a Hugging Face directory."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.launch.local_run import LocalRun
from services.front_door.export_command import export_checkpoint
from services.model.init_model import init_model
from services.run_contract.checkpoint import checkpoints
from services.run_contract.run_config import RunConfig
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=9)


def test_sigterm_checkpoints_the_last_step_and_the_restart_resumes_after_it(model_dir, tmp_path, fork_server):
    run = RunConfig(
        name="sigterm",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=8,
        micro_batch_size=4,
        num_steps=10,
        checkpoint={"keep_last": 1},
        rollout={"max_new_tokens": 12},
        optim={"lr": 1e-4},
    )
    ckpt = str(tmp_path / "ckpt")
    with LocalRun(run, log_dir=str(tmp_path / "logs"), checkpoint_dir=ckpt, forker=fork_server) as lr:
        lr.wait_for_step(2, 300)
        # paused, the rollout admits nothing more: the trainer stops within max_staleness + 1 steps of here,
        # far from the last step, however fast this machine trains (unpaused, it once finished all 5 first)
        with lr.dcs_client() as dcs:
            dcs.pause(run.name)
        assert lr.progress().next_step < run.num_steps
        assert checkpoints(ckpt, "actor") == []  # no interval: nothing written while it runs
        assert lr.procs["trainer"].stop(timeout_s=120) == 0  # SIGTERM: a clean exit
        stopped = lr.progress()
        [state] = checkpoints(ckpt, "actor")
        assert (state.next_step, state.version) == (stopped.next_step, stopped.version)
        assert 2 <= stopped.next_step < run.num_steps
        lr.start_role("trainer")
        with lr.dcs_client() as dcs:
            dcs.resume(run.name)
        lr.wait_for_step(run.num_steps, 400)
        steps = assert_run_complete(lr, run)  # every sample trained exactly once
        final = lr.progress()
    log = (tmp_path / "logs" / "trainer.log").read_text()
    positions = [json.loads(line) for line in log.splitlines() if '"trainer position"' in line]
    assert [(p["next_step"], p["checkpoint"]) for p in positions] == [(0, None), (stopped.next_step, state.path)]
    assert "lost with the process" not in log  # no trained step was dropped by the restart
    assert [steps[s]["metrics"]["weight_version"] for s in sorted(steps)] == list(range(1, run.num_steps + 1))
    # the finished run checkpointed its last step (keep_last 1: only that one is left), and it exports
    [last] = checkpoints(ckpt, "actor")
    assert (last.next_step, last.version) == (run.num_steps, final.version)
    export_checkpoint(ckpt, str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    assert any(not torch.equal(p, q) for p, q in zip(exported.parameters(), initial.parameters()))
