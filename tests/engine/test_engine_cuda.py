"""The engine on a GPU (`--device cuda`), as its own process: exact log-probs and greedy in float32, seeded
sampling and shared-prompt groups, bfloat16, a weight update broadcast from a CPU trainer over gloo, and the
KV pool capped by --mem-fraction-static. Skipped where torch sees no GPU (CI has none); run on a GPU with
`python -m pytest tests/engine/test_engine_cuda.py`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from services.dcs.sync.groups import BroadcastGroup
from services.engine.server import tokens_that_fit
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.runtime.processes import free_port
from services.sglang_protocol.client import SGLangClient
from tests.engine.conftest import start_engine

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device: the engine's GPU path cannot run here")


def test_the_pool_budget_is_what_the_fraction_leaves_after_the_weights():
    assert tokens_that_fit(1000, 300, 0.5, 10) == 20  # 500 of the device, 300 taken by the weights
    assert tokens_that_fit(1000, 600, 0.5, 10) == 0  # the weights alone are over the fraction


def _gen(url: str, **body) -> dict | list:
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _teacher_forced(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    ids = torch.tensor([prompt + output], device=model.device)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


@pytest.fixture(scope="module")
def cuda_engine(tiny_model_dir, tmp_path_factory):
    proc, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("cuda-engine"), "--device", "cuda")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, "float32", "cuda")[0] if CUDA else None


@needs_cuda
def test_float32_logprobs_and_greedy_match_transformers_on_the_gpu(cuda_engine, reference):
    prompts = [[5, 17, 300, 2, 9], [44, 9], [100, 200, 300, 400, 500, 600, 700], [3]]
    temperatures = [1.0, 0, 0.7, 0]
    body = dict(
        input_ids=prompts,
        return_logprob=True,
        sampling_params=[
            {"max_new_tokens": 24, "temperature": t, "sampling_seed": i, "ignore_eos": True}
            for i, t in enumerate(temperatures)
        ],
    )
    for prompt, t, out in zip(prompts, temperatures, _gen(cuda_engine, **body)):
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        ref = _teacher_forced(reference, prompt, out["output_ids"], t or 1.0)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-4
        if t == 0:
            ids = torch.tensor([prompt], device="cuda")
            greedy = reference.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert out["output_ids"] == greedy[0, len(prompt) :].tolist()


@needs_cuda
def test_seeded_samples_repeat_and_a_group_prefills_once(cuda_engine):
    prompt = [7, 70, 700, 17, 170]
    body = dict(
        input_ids=[prompt] * 4,
        return_logprob=True,
        sampling_params=[
            {
                "max_new_tokens": 16,
                "temperature": 1.0,
                "top_p": 0.9,
                "top_k": 50,
                "sampling_seed": 100 + k,
                "ignore_eos": True,
            }
            for k in range(4)
        ],
    )
    first, again = _gen(cuda_engine, **body), _gen(cuda_engine, **body)
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    assert len({tuple(r["output_ids"]) for r in first}) > 1
    assert sorted(r["meta_info"]["cached_tokens"] for r in first) == [0, 5, 5, 5]


@needs_cuda
def test_bfloat16_serves_with_logprobs_close_to_its_own_forward(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir, "bfloat16", "cuda")[0]
    proc, url = start_engine(tiny_model_dir, tmp_path, "--device", "cuda", "--dtype", "bfloat16")
    try:
        prompt = [12, 34, 56, 78]
        out = _gen(
            url,
            input_ids=prompt,
            return_logprob=True,
            sampling_params={"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
        )
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert len(out["output_ids"]) == 32
        # bfloat16 keeps 8 bits of mantissa: batched and unbatched kernels round differently
        assert max(abs(a - b) for a, b in zip(lps, _teacher_forced(model, prompt, out["output_ids"]))) < 0.1
    finally:
        proc.stop()


@needs_cuda
def test_a_weight_update_from_a_cpu_trainer_reaches_the_gpu_engine(cuda_engine, tmp_path):
    """SGLang's update protocol driven by hand (what DCS's publisher does): this process is rank 0 of a gloo
    group with the engine, broadcasts every tensor from the CPU, and the engine receives onto its GPU."""
    other = load_causal_lm(init_model(str(tmp_path / "other"), preset="tiny", arch="qwen2", seed=99))[0]
    prompt = [11, 22, 33]
    expected = other.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 3:].tolist()
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    client, port, named = SGLangClient(cuda_engine), free_port(), list(other.state_dict().items())
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, "g", "gloo")
        group = BroadcastGroup.open("g", "gloo", "127.0.0.1", port, 0, 2, 60)
        joined.result(60)
        loaded = pool.submit(
            client.update_weights_from_distributed,
            [n for n, _ in named],
            ["float32"] * len(named),
            [list(t.shape) for _, t in named],
            "g",
            "7",
        )
        for _, tensor in named:
            group.broadcast(tensor.contiguous(), 0)
        loaded.result(60)
        group.close()
    assert client.weight_version() == "7"
    assert _gen(cuda_engine, input_ids=prompt, sampling_params=greedy)["output_ids"] == expected


@needs_cuda
def test_the_pool_fits_the_memory_fraction(tiny_model_dir, tmp_path):
    """A fraction that leaves room for two requests of the context: the engine serves four, two at a time."""
    model = load_causal_lm(tiny_model_dir)[0]
    cfg = model.config
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    weights = sum(p.numel() * 4 for p in model.parameters())
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = (weights + 2.5 * 256 * token_bytes) / total
    proc, url = start_engine(
        tiny_model_dir, tmp_path, "--device", "cuda", "--context-length", "256", "--mem-fraction-static", repr(fraction)
    )
    try:
        assert '"slots": 2,' in proc.log_tail()
        out = _gen(
            url, input_ids=[[1, 2, 3]] * 4, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        )
        assert [len(r["output_ids"]) for r in out] == [16] * 4
    finally:
        proc.stop()
