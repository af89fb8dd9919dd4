"""A LoRA run's weight updates (services/engine/adapter_merge.py): the built-in engine merges a published adapter
into the base weights it keeps, so it generates what transformers generates with peft's merged model, and a
second adapter replaces the first exactly (nothing accumulates)."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.precision import WeightMismatch
from services.dcs.sync.publisher import WeightPublisher
from services.engine.weight_updates import WeightUpdates
from services.model.loading import load_causal_lm
from services.sglang_protocol.client import SGLangClient
from services.sglang_protocol.lora_adapters import run_adapter
from tests.engine.conftest import start_engine
from tests.engine.test_weight_updates import FakeScheduler

PROMPT = [11, 22, 33]
LORA = LoraConfig(r=4, lora_alpha=12.0, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
SCALING = 12.0 / 4


def _adapter(model_dir: str, seed: int):
    """A peft model of the base with a trained-looking adapter (B random, not zero): its tensors as published
    (peft's saved names) and its merged model."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(load_causal_lm(model_dir)[0], copy.deepcopy(LORA))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tensors = {n: t.detach().clone() for n, t in get_peft_model_state_dict(peft_model).items()}
    return tensors, peft_model.merge_and_unload()


def _greedy_hf(model) -> list[int]:
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, 3:
    ].tolist()


def _greedy(url: str) -> list[int]:
    r = httpx.post(
        url + "/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
        timeout=60,
    )
    return r.json()["output_ids"]


async def _generate_named(url: str, adapter):
    client = SGLangClient(url)
    try:
        return (
            await client.generate_batch(
                [PROMPT], [{"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}], adapter=adapter
            )
        )[0]
    finally:
        await client.aclose()
        client.close()


@pytest.mark.slow
def test_engine_serves_the_merged_adapter_and_the_next_one_replaces_it(tiny_model_dir, tmp_path):
    first, merged_first = _adapter(tiny_model_dir, 1)
    second, merged_second = _adapter(tiny_model_dir, 2)
    expected = [_greedy_hf(merged_first), _greedy_hf(merged_second)]
    base = _greedy_hf(load_causal_lm(tiny_model_dir)[0])
    assert expected[0] != expected[1] and base not in expected  # the adapters change what is generated
    proc, url = start_engine(tiny_model_dir, tmp_path)
    try:
        with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
            port = int(url.rsplit(":", 1)[1])
            dcs.register(NodeRegistration(role="engine", host="127.0.0.1", ports={"http": port}, run_id="w"))
            trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="w"))
            publisher = WeightPublisher(
                dcs,
                trainer.node_id,
                "127.0.0.1",
                bucket_bytes=4096,
                timeout_s=20,
                receiver_roles=["engine"],
                pause_mode="auto",
                run_id="w",
            )
            publisher.adapter_scaling = SCALING
            for version, (tensors, want) in enumerate(zip((first, second, first), expected + expected[:1]), 1):
                result = publisher.publish(list(tensors.items()), version)
                assert result.ok and _greedy(url) == want, version  # the third: the first again, not a sum
            # a LoRA run's rollout asks for the run's adapter: this engine has it merged, so it is not named
            named = asyncio.run(_generate_named(url, run_adapter("w", 3)))
            assert named.output_ids == expected[0] and named.spans == [("3", 0, 8)]
            full = sum(p.numel() * 4 for p in load_causal_lm(tiny_model_dir)[0].parameters())
            assert result.bytes == sum(t.numel() * 4 for t in first.values()) and result.bytes < full / 10
            publisher.close()
    finally:
        proc.stop()


def _updates(model_dir: str):
    model = load_causal_lm(model_dir)[0]
    return WeightUpdates(model, FakeScheduler(), "cpu"), model


def test_merge_is_exact_and_reversible(tiny_model_dir):
    updates, model = _updates(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors, merged = _adapter(tiny_model_dir, 3)
    for _ in range(2):  # the same adapter twice: W0 + s B A both times
        updates._stage(lambda: dict(tensors), "1", SCALING)
        updates.load()
    for name, p in merged.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p, atol=1e-6, rtol=1e-6)
    zero = {n: torch.zeros_like(t) if "lora_B" in n else t for n, t in tensors.items()}
    updates._stage(lambda: zero, "2", SCALING)
    updates.load()
    for name, p in model.named_parameters():  # bit for bit the base again: W0 was kept, nothing subtracted
        assert torch.equal(p, before[name]), name


def test_a_bad_adapter_is_refused_and_changes_nothing(tiny_model_dir):
    updates, model = _updates(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors, _ = _adapter(tiny_model_dir, 4)
    with pytest.raises(WeightMismatch, match="without the update's lora_scaling"):
        updates._stage(lambda: dict(tensors), "1", None)
    name = next(n for n in tensors if "lora_A" in n)
    with pytest.raises(WeightMismatch, match="does not fit"):
        updates._stage(lambda: {name: torch.zeros(4, 7)}, "1", SCALING)
    with pytest.raises(WeightMismatch, match="no linear layer"):
        updates._stage(lambda: {"base_model.model.model.nothing.lora_A.weight": torch.zeros(4, 7)}, "1", SCALING)
    updates._stage(lambda: {name: tensors[name]}, "1", SCALING)  # an A without its B
    with pytest.raises(WeightMismatch, match="incomplete"):
        updates.load()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
