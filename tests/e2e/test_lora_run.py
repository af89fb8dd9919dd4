"""A LoRA run end to end (run config trainer.lora): every step trains and publishes only the adapter (bytes per
publish far below the full model's), and at the end the engine serves the base model with the last adapter merged:
it generates what transformers generates with peft's merge of the final checkpoint. With SGLang engines the
adapter goes through SGLang's LoRA routes: loaded by name from files, named by the rollout's requests."""

from __future__ import annotations

import os
import pathlib

import httpx
import pytest
import torch

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import latest_checkpoint
from tests.e2e.run_checks import assert_run_complete
from tests.e2e.test_run_lifecycle import small_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = [11, 22, 33]
ROOT = pathlib.Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "launch" / "fake_sglang"  # `python -m sglang.launch_server`: the SGLang 0.5.23 stand-in


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def _lora_run(name: str, model_dir: str):
    run = small_run(name, model_dir, num_steps=3)
    return run.model_copy(
        update={
            "trainer": run.trainer.model_validate({"lora": {"rank": 4, "alpha": 8.0}}),
            "optim": run.optim.model_copy(update={"lr": 5e-2}),
            "checkpoint": run.checkpoint.model_copy(update={"interval": 1}),
        }
    )


def test_a_lora_run_trains_every_step_and_the_engine_serves_the_merged_adapter(model_dir, tmp_path, fork_server):
    from peft import PeftModel

    run = _lora_run("lora", model_dir)
    ckpts = str(tmp_path / "ckpt")
    with LocalRun(run, log_dir=str(tmp_path / "logs"), checkpoint_dir=ckpts, forker=fork_server) as lr:
        lr.wait_for_step(run.num_steps, 300)
        steps = assert_run_complete(lr, run)
        with lr.dcs_client() as dcs:
            assert dcs.status(run.name).latest_weight_version == 3
        served = httpx.post(
            lr.engine_urls[0] + "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
            timeout=60,
        ).json()["output_ids"]
    base = load_causal_lm(model_dir)[0]
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    sent = [steps[s]["metrics"]["publish_bytes"] for s in range(run.num_steps)]
    assert all(0 < b < full_bytes / 20 for b in sent), (sent, full_bytes)
    last = latest_checkpoint(ckpts, "actor")
    assert last.next_step == 3 and last.version == 3
    merged = PeftModel.from_pretrained(base, last.path).merge_and_unload()
    expected = merged.generate(
        torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 3:].tolist()
    untrained = (
        load_causal_lm(model_dir)[0]
        .generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 3:]
        .tolist()
    )
    assert served == expected and expected != untrained  # the trained adapter, merged, and it changed the model


def test_a_lora_run_on_sglang_engines_loads_each_adapter_by_name_and_the_rollout_generates_from_it(
    model_dir, tmp_path, monkeypatch
):
    """SGLang engines (the 0.5.23 stand-in behind its launcher, tests/launch/fake_sglang, given the model) are
    launched with LoRA on, load each version's adapter from the trainer's files by name, and unload the ones
    before the previous; the rollout's requests name the adapter of their engine's version; the last adapter
    serves what peft's merge of the final checkpoint generates."""
    from peft import PeftModel

    monkeypatch.syspath_prepend(str(FAKE))  # where LocalRun looks for SGLang: this Python
    run = _lora_run("lora-sgl", model_dir)
    ckpts, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    with LocalRun(run, log_dir=logs, checkpoint_dir=ckpts, engine="sglang", python_path=(str(FAKE), str(ROOT))) as lr:
        lr.wait_for_step(run.num_steps, 300)
        steps = assert_run_complete(lr, run, engine_urls=[])  # SGLang 0.5.23 says its version in /model_info
        url = lr.engine_urls[0]
        assert httpx.get(url + "/model_info").json()["weight_version"] == "3"
        args = httpx.get(url + "/fake_launch").json()["args"]
        stats = httpx.get(url + "/stats").json()
        served = httpx.post(
            url + "/generate",
            json={
                "input_ids": PROMPT,
                "lora_path": "lora-sgl-v3",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            },
            timeout=60,
        ).json()["output_ids"]
    assert (args["enable_lora"], args["max_lora_rank"], args["lora_target_modules"]) == (
        True,
        4,
        run.trainer.lora.target_modules,
    )
    assert stats["lora"] == [
        ["load", "lora-sgl-v1"],
        ["load", "lora-sgl-v2"],
        ["load", "lora-sgl-v3"],
        ["unload", "lora-sgl-v1"],
    ]  # the one before the last stays loaded
    assert stats["pauses"] == [] and stats["calls"] == []  # nothing paused, nothing broadcast
    named = set(stats["generated"])  # the adapter each generated sample's request named (None: the base model)
    assert named <= {None, "lora-sgl-v1", "lora-sgl-v2"} and named - {None}, named
    assert sorted(os.listdir(os.path.join(logs, run.name, "adapters"))) == ["lora-sgl-v2", "lora-sgl-v3"]
    base = load_causal_lm(model_dir)[0]
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    assert all(0 < steps[s]["metrics"]["publish_bytes"] < full_bytes / 20 for s in range(run.num_steps))
    merged = PeftModel.from_pretrained(base, latest_checkpoint(ckpts, "actor").path).merge_and_unload()
    assert (
        served
        == merged.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 3:].tolist()
    )
