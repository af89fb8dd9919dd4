"""The precision contract in whole runs: a float32 trainer's weights reach a bfloat16 engine (in bf16, half the
bytes) and every sample is trained once; an engine whose model the weights do not fit fails the run within a
bound, naming the tensor, instead of the trainer re-sending for ever."""

from __future__ import annotations

import time

import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from tests.e2e.run_checks import assert_run_complete
from tests.e2e.test_run_lifecycle import ROLES, small_run, wait_for_exit, wait_for_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def test_a_bfloat16_engine_with_a_float32_trainer_trains_every_sample_once(model_dir, tmp_path, fork_server):
    run = small_run("bf16-engine", model_dir, num_steps=3).model_copy(update={"max_staleness": 1})
    with LocalRun(run, log_dir=str(tmp_path / "logs"), engine_args=("--dtype", "bfloat16"), forker=fork_server) as lr:
        lr.wait_for_step(run.num_steps, 300)
        steps = assert_run_complete(lr, run)
        assert [steps[s]["metrics"]["weight_version"] for s in range(3)] == [1, 2, 3]
        with lr.dcs_client() as dcs:
            trainer = [r for r in dcs.sync_reports(run.name, 200) if "pack" in r.seconds]
            engine_version = dcs.status(run.name).latest_weight_version
    from services.model.loading import load_causal_lm

    fp32_bytes = sum(p.numel() * 4 for p in load_causal_lm(model_dir)[0].parameters())
    assert trainer and all(r.ok and r.bytes < 0.55 * fp32_bytes for r in trainer), trainer  # sent in bf16
    assert engine_version == 3


def test_weights_an_engine_cannot_take_fail_the_run_naming_the_tensor(model_dir, tmp_path, fork_server):
    wrong = init_model(str(tmp_path / "wrong"), preset="small", arch="qwen2", seed=7)  # same vocabulary, wider
    run = small_run("refused", model_dir, num_steps=3)
    began = time.monotonic()
    with LocalRun(
        run, log_dir=str(tmp_path / "logs"), engine_args=("--model", wrong), submit=False, forker=fork_server
    ) as lr:
        lr.submit()
        failure = wait_for_status(lr, run.name, "failed", 180).failure
        took = time.monotonic() - began
        assert failure.role == "trainer" and "refused" in failure.message, failure
        assert "model.embed_tokens.weight" in failure.message, failure
        codes = wait_for_exit(lr, ROLES, 120)
        assert codes["trainer"] != 0, codes
    # the first step's publish fails it: no resend loop (each resend waited 20 s; five retries, 24 s of backoff)
    assert took < 150, took
