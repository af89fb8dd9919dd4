"""Weights over the GPU, not through host memory (run where torch sees a GPU; skipped on CI's CPUs, run by
benchmarks/gpu_check.py): a trainer on the engine's own GPU sends its buckets by CUDA IPC handle (sync backend
auto picks ipc), cast to the engine's bfloat16, and the engine then serves exactly what an engine started from
those weights serves; with two GPUs, auto picks NCCL."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import WeightPublisher
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from tests.engine.conftest import start_engine

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _greedy(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(
        url + "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
        timeout=60,
    )
    return r.json()["output_ids"]


def _publish_to(engine_url: str, tmp_path, named, device: str) -> object:
    with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
        port = int(engine_url.rsplit(":", 1)[1])
        dcs.register(NodeRegistration(role="engine", host="127.0.0.1", ports={"http": port}, run_id="w"))
        trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="w", device=device))
        publisher = WeightPublisher(
            dcs,
            trainer.node_id,
            "127.0.0.1",
            bucket_bytes=100_000,
            timeout_s=60,
            receiver_roles=["engine"],
            pause_mode="auto",
            run_id="w",
            backend="auto",
            device=device,
        )
        try:
            return publisher.publish(named, 1)
        finally:
            publisher.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return (
        init_model(str(base / "start"), preset="tiny", arch="qwen2", seed=7),
        init_model(str(base / "trained"), preset="tiny", arch="qwen2", seed=99),
    )


def test_a_trainer_on_the_engines_gpu_sends_by_cuda_ipc_in_the_engines_dtype(models, tmp_path):
    start, trained = models
    prompt = [11, 22, 33]
    engine, url = start_engine(start, tmp_path, "--device", "cuda", "--dtype", "bfloat16")
    reference, reference_url = start_engine(trained, tmp_path, "--device", "cuda", "--dtype", "bfloat16")
    try:
        weights = load_causal_lm(trained, "float32", "cuda")[0]
        result = _publish_to(url, tmp_path, list(weights.named_parameters()), "cuda")
        assert result.ok and result.backend == "ipc" and result.wire_dtype == "bfloat16", result
        assert result.world_size == 2 and "broadcast" in result.seconds
        assert _greedy(url, prompt) == _greedy(reference_url, prompt)
        assert httpx.get(url + "/weight_version").json()["weight_version"] == "1"
    finally:
        engine.stop()
        reference.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the engine on another GPU")
def test_a_trainer_on_another_gpu_broadcasts_over_nccl(models, tmp_path):
    start, trained = models
    engine, url = start_engine(start, tmp_path, "--device", "cuda:1")
    try:
        weights = load_causal_lm(trained, "float32", "cuda:0")[0]
        result = _publish_to(url, tmp_path, list(weights.named_parameters()), "cuda:0")
        assert result.ok and result.backend == "nccl", result
        expected = weights.generate(
            torch.tensor([[11, 22, 33]], device="cuda:0"),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, 3:].tolist()
        assert _greedy(url, [11, 22, 33]) == expected
    finally:
        engine.stop()
