"""A LoRA publish to SGLang engines (services/dcs/sync/adapter_publish.py): the trainer's publisher writes each
version's adapter in peft's files and has the SGLang stand-in (tests/dcs/sglang_receiver.py, release 0.5.23 with
a model, tests/dcs/sglang_generation.py) load it by name, switch its weight version and unload the adapters
before the previous one. No broadcast, no pause. An engine launched without LoRA refuses for good."""

from __future__ import annotations

import copy
import json
import os
import sys

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import SyncFailed, WeightPublisher
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.runtime.processes import ChildProcess, free_port, http_ok
from tests.dcs.test_sglang_protocol import _wait_engines
from tests.worker_fork_server import worker_fork_server

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # server processes; ./dev test runs it
PROMPT = [11, 22, 33]
LORA = LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=5)


def _engine(tmp_path, dcs_url: str, run_id: str, model_dir: str, *lora: str) -> tuple[ChildProcess, str]:
    port = free_port()
    proc = ChildProcess(
        f"sglang-{port}",
        [
            sys.executable,
            "-m",
            "tests.dcs.sglang_receiver",
            "--port",
            str(port),
            "--dcs",
            dcs_url,
            "--run-id",
            run_id,
            "--release",
            "0.5.23",
            "--model-path",
            model_dir,
            *lora,
        ],
        str(tmp_path / f"sglang-{port}.log"),
        forker=worker_fork_server(),
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/stats"), 120)
    return proc, url


def _adapter(model_dir: str, seed: int):
    """(the adapter's tensors as a LoRA trainer publishes them, its adapter_config.json, the merged model)."""
    torch.manual_seed(seed)
    model = get_peft_model(load_causal_lm(model_dir)[0], copy.deepcopy(LORA))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tensors = [(n, t.detach().clone()) for n, t in get_peft_model_state_dict(model).items()]
    config = json.loads(
        json.dumps(
            model.peft_config["default"].to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)
        )
    )
    return tensors, config, model.merge_and_unload()


def _greedy(url: str, adapter: str | None) -> list[int]:
    return httpx.post(
        url + "/generate",
        json={
            "input_ids": PROMPT,
            "lora_path": adapter,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    ).json()["output_ids"]


def _publisher(dcs: DCSClient, run_id: str, adapter_dir: str | None, config: dict) -> WeightPublisher:
    trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id=run_id))
    publisher = WeightPublisher(
        dcs,
        trainer.node_id,
        "127.0.0.1",
        timeout_s=20,
        receiver_roles=["engine"],
        run_id=run_id,
        adapter_dir=adapter_dir,
    )
    publisher.adapter_scaling, publisher.adapter_config = LORA.lora_alpha / LORA.r, config
    return publisher


def test_each_version_is_loaded_by_name_switched_to_and_the_ones_before_the_last_unloaded(model_dir, tmp_path):
    adapters = [_adapter(model_dir, seed) for seed in (1, 2, 3)]
    files = tmp_path / "adapters"
    with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
        procs = [
            _engine(
                tmp_path,
                local.url,
                "lr",
                model_dir,
                "--enable-lora",
                "--max-lora-rank",
                "8",
                "--lora-target-modules",
                "q_proj",
                "v_proj",
            )
            for _ in range(2)
        ]
        try:
            _wait_engines(dcs, "lr", 2)
            publisher = _publisher(dcs, "lr", str(files), adapters[0][1])
            for version, (tensors, _, merged) in enumerate(adapters, 1):
                result = publisher.publish(tensors, version)
                assert result.ok and result.transfer == "adapter_files" and result.world_size == 3
                assert result.bytes == sum(t.numel() * 4 for _, t in tensors)
                want = merged.generate(
                    torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
                )[0, 3:].tolist()
                for _, url in procs:
                    assert httpx.get(url + "/model_info").json()["weight_version"] == str(version)
                    assert _greedy(url, f"lr-v{version}") == want != _greedy(url, None)
            # a resend (an engine that restarted, the others holding the version already) loads it again
            assert publisher.publish(adapters[2][0], 3, announce=False).ok
            for _, url in procs:
                stats = httpx.get(url + "/stats").json()
                assert stats["pauses"] == [] and stats["calls"] == []  # neither paused nor broadcast to
                assert stats["lora"] == [["load", "lr-v1"], ["load", "lr-v2"], ["load", "lr-v3"], ["unload", "lr-v1"]]
            assert sorted(os.listdir(files)) == ["lr-v2", "lr-v3"]
            assert sorted(os.listdir(files / "lr-v3")) == ["adapter_config.json", "adapter_model.safetensors"]
            latest = dcs.latest_weights("lr")  # recorded with the coordinator, nothing to broadcast
            assert (latest.version, latest.transfer) == (3, "adapter_files")
            publisher.close()
        finally:
            for proc, _ in procs:
                proc.stop()


def test_an_engine_without_lora_or_a_trainer_without_a_directory_refuses_for_good(model_dir, tmp_path):
    tensors, config, _ = _adapter(model_dir, 4)
    with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
        proc, url = _engine(tmp_path, local.url, "nl", model_dir)
        try:
            _wait_engines(dcs, "nl", 1)
            publisher = _publisher(dcs, "nl", str(tmp_path / "adapters"), config)
            with pytest.raises(SyncFailed) as exc:
                publisher.publish(tensors, 1)
            assert exc.value.result.refused and not exc.value.result.announced
            assert f"which these engines do not take: {url}" in str(exc.value)
            assert "launched with --enable-lora" in str(exc.value)
            publisher.close()
        finally:
            proc.stop()
        proc, url = _engine(
            tmp_path,
            local.url,
            "nd",
            model_dir,
            "--enable-lora",
            "--max-lora-rank",
            "2",
            "--lora-target-modules",
            "q_proj",
            "v_proj",
        )
        try:
            _wait_engines(dcs, "nd", 1)
            for directory, reason in (
                (None, "no directory to write them to"),
                (str(tmp_path / "small"), f"the SGLang server at {url} did not load LoRA adapter nd-v1 from"),
            ):
                publisher = _publisher(dcs, "nd", directory, config)
                with pytest.raises(SyncFailed) as exc:
                    publisher.publish(tensors, 1)
                assert exc.value.result.refused and reason in str(exc.value), exc.value
                publisher.close()
            assert "with rank 4 is incompatible" in str(exc.value)  # SGLang's own reason, passed on
        finally:
            proc.stop()
