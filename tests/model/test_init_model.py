"""`sluice init-model` writes models transformers loads offline, for both architectures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.model.init_model import init_model
from services.model.loading import load_causal_lm


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_init_model_writes_a_loadable_model_and_tokenizer(tmp_path, arch):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "init-model",
            str(tmp_path / "a"),
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--seed",
            "3",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    init_model(str(tmp_path / "b"), preset="tiny", arch=arch, seed=3)
    model, tokenizer = load_causal_lm(str(tmp_path / "a"))
    other, _ = load_causal_lm(str(tmp_path / "b"))
    assert model.config.model_type == arch
    names = [n for n, _ in model.named_parameters()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names  # HF names: the wire format
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n  # the same seed gives the same weights
    text = "What is 12 + 7? The answer is \\boxed{19}."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text and len(ids) < len(text)  # BPE merges, lossless
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4) or int(out[0, -1]) == tokenizer.eos_token_id
