"""SGLangClient's calls of SGLang's LoRA adapter routes (services/sglang_protocol/lora_adapters.py) against the
SGLang 0.5.23 stand-in behind its launcher (tests/launch/fake_sglang, serving tests/dcs/sglang_generation.py):
an adapter in peft's files is loaded by path, a generate request that names it is served by the base model with
the adapter merged (what peft's merge_and_unload generates), and SGLang's refusals come back as SGLangError with
SGLang's reason."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

import httpx
import pytest
import torch

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.runtime.processes import ChildProcess, free_port, http_ok
from services.sglang_protocol.client import SGLangClient, SGLangError
from services.sglang_protocol.lora_adapters import NamedAdapter, adapter_version, run_adapter

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # server processes; ./dev test runs it
ROOT = pathlib.Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "launch" / "fake_sglang"
PROMPT = [11, 22, 33]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _server(tmp_path, model_dir: str, *flags: str) -> tuple[ChildProcess, str]:
    port = free_port()
    proc = ChildProcess(
        f"sglang-{port}",
        [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port), *flags],
        str(tmp_path / f"sglang-{port}.log"),
        env={"PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT)])},
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/health"), 120)
    return proc, url


def _adapter(model_dir: str, directory: str, rank: int, seed: int):
    """A peft adapter on q_proj and v_proj with non-zero B, saved in peft's files; the merged model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        load_causal_lm(model_dir)[0],
        LoraConfig(r=rank, lora_alpha=2.0 * rank, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(directory)
    return model.merge_and_unload()


def _greedy(model) -> list[int]:
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, 3:
    ].tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=3)


@pytest.fixture(scope="module")
def lora_server(model_dir, tmp_path_factory):
    proc, url = _server(
        tmp_path_factory.mktemp("lora"),
        model_dir,
        "--enable-lora",
        "--max-lora-rank",
        "4",
        "--lora-target-modules",
        "q_proj",
        "k_proj",
        "v_proj",
    )
    yield url
    proc.stop()


def _generate(client: SGLangClient, adapter: NamedAdapter | None):
    async def go():
        try:
            return (await client.generate_batch([PROMPT], [GREEDY], adapter=adapter))[0]
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_loaded_adapter_serves_what_peft_merges_and_unloading_it_leaves_the_base(lora_server, model_dir, tmp_path):
    client = SGLangClient(lora_server)
    assert client.serves_lora_adapters() and client.lora_limits() == (4, ["k_proj", "q_proj", "v_proj"])
    merged = _adapter(model_dir, str(tmp_path / "a"), rank=4, seed=0)
    assert client.load_lora_adapter("run-v1", str(tmp_path / "a")) == {"run-v1": str(tmp_path / "a")}
    client.set_weight_version("1")
    served = _generate(client, run_adapter("run", 1))
    assert served.output_ids == _greedy(merged) != _greedy(load_causal_lm(model_dir)[0])
    assert served.spans == [("1", 0, 6)]  # its tokens come from the adapter's version
    base = _generate(client, None)
    assert base.output_ids == _greedy(load_causal_lm(model_dir)[0])

    _adapter(model_dir, str(tmp_path / "b"), rank=2, seed=1)
    assert client.load_lora_adapter("run-v2", str(tmp_path / "b")) == {
        "run-v1": str(tmp_path / "a"),
        "run-v2": str(tmp_path / "b"),
    }
    assert client.unload_lora_adapter("run-v1") == {"run-v2": str(tmp_path / "b")}
    listed = httpx.get(lora_server + "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in listed[1:]] == [("run-v2", str(tmp_path / "b"))]
    with pytest.raises(SGLangError) as exc:
        client.unload_lora_adapter("run-v1")
    assert exc.value.status == 400 and "LoRA with name run-v1 does not exist" in exc.value.message
    # SGLang loads an adapter it once loaded again from its path when a request names it
    assert _generate(client, run_adapter("run", 1)).output_ids == _greedy(merged)
    assert httpx.get(lora_server + "/stats").json()["lora"][-1] == ["reload", "run-v1"]
    client.unload_lora_adapter("run-v1")
    client.unload_lora_adapter("run-v2")
    client.close()


def test_sglangs_refusals_come_back_with_its_reasons(lora_server, model_dir, tmp_path):
    client = SGLangClient(lora_server)
    _adapter(model_dir, str(tmp_path / "a"), rank=4, seed=2)
    _adapter(model_dir, str(tmp_path / "big"), rank=8, seed=3)
    client.load_lora_adapter("r-v1", str(tmp_path / "a"))
    refusals = {
        "already loaded": lambda: client.load_lora_adapter("r-v1", str(tmp_path / "a")),
        "with rank 8 is incompatible with the current LoRA memory pool": lambda: client.load_lora_adapter(
            "r-v2", str(tmp_path / "big")
        ),
        "Repo id must be in the form": lambda: client.load_lora_adapter("r-v3", str(tmp_path / "nowhere")),
        "Got LoRA adapter that has never been loaded: r-v9": lambda: _generate(client, run_adapter("r", 9)),
    }
    for reason, call in refusals.items():
        with pytest.raises(SGLangError) as exc:
            call()
        assert exc.value.status == 400 and reason in exc.value.message, exc.value
    assert client.unload_lora_adapter("r-v1") == {}
    client.close()


def test_a_server_launched_without_lora_refuses_adapters(model_dir, tmp_path):
    proc, url = _server(tmp_path, model_dir)
    try:
        client = SGLangClient(url)
        assert not client.serves_lora_adapters()
        with pytest.raises(SGLangError, match="LoRA is not enabled. Please set `--enable-lora`"):
            client.load_lora_adapter("x-v1", str(tmp_path))
        with pytest.raises(SGLangError, match="LoRA adapter 'x-v1' was requested, but LoRA is not enabled"):
            _generate(client, run_adapter("x", 1))
        client.close()
    finally:
        proc.stop()
    # SGLang's start check: LoRA with neither adapters to preload nor the pool's rank and modules
    port = free_port()
    proc = ChildProcess(
        "no-rank",
        [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port), "--enable-lora"],
        str(tmp_path / "no-rank.log"),
        env={"PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT)])},
    )
    assert proc.proc.wait(timeout=120) != 0
    assert "you need to specify both --max-lora-rank and --lora-target-modules" in proc.log_tail()


def test_adapter_names_carry_the_run_and_version():
    assert run_adapter("demo.1", 12) == NamedAdapter("demo.1-v12", 12)
    assert adapter_version("demo.1", "demo.1-v12") == 12
    assert adapter_version("demo", "demo.1-v12") is None and adapter_version("a", "a-v1-v3") is None
