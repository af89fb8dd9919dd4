"""The engine's ragged-batch forward equals the Hugging Face model's own forward."""

from __future__ import annotations

import pytest
import torch

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.ragged_decoder import KVCache, RaggedDecoder


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    path = init_model(str(tmp_path_factory.mktemp(request.param)), preset="tiny", arch=request.param, seed=1)
    return load_causal_lm(path)[0]


def test_mixed_prefill_chunks_and_decodes_match_full_forward(model):
    dec = RaggedDecoder(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (5, 9, 1, 13)]
    caches = [KVCache() for _ in seqs]
    # step 1: chunks of two prompts and a whole third; step 2: the rest of those, joined by a fourth
    first = dec.forward([seqs[0][:3], seqs[1][:3], seqs[2]], caches[:3], all_logits=True)
    second = dec.forward([seqs[0][3:], seqs[1][3:], seqs[3]], [caches[0], caches[1], caches[3]], all_logits=True)
    got = [torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]), first[2], second[2]]
    for s, mine in zip(seqs, got):
        ref = model(s.unsqueeze(0)).logits[0]
        assert torch.allclose(mine, ref, atol=1e-5, rtol=0), (mine - ref).abs().max()
    assert [c.length for c in caches] == [5, 9, 1, 13]


def test_greedy_decoding_equals_transformers_generate(model):
    dec = RaggedDecoder(model)
    prompts = [torch.tensor([5, 17, 300, 2]), torch.tensor([44, 9])]
    caches = [KVCache() for _ in prompts]
    out = [[] for _ in prompts]
    logits = dec.forward(prompts, caches)
    for _ in range(6):  # decode both sequences together, one token each per step
        nxt = [int(l.argmax()) for l in logits]
        for o, t in zip(out, nxt):
            o.append(t)
        logits = dec.forward([torch.tensor([t]) for t in nxt], caches)
    for p, o in zip(prompts, out):
        ref = model.generate(p.unsqueeze(0), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):]
        assert o == ref.tolist()


def test_many_sequences_decoding_together_match_one_by_one(model):
    """One-token steps of sequences with different cache lengths are attended in one padded call."""
    dec = RaggedDecoder(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (2, 7, 4, 11, 1)]
    together = [KVCache() for _ in prompts]
    alone = [KVCache() for _ in prompts]
    dec.forward(prompts, together)
    for p, c in zip(prompts, alone):
        dec.forward([p], [c])
    step = [torch.tensor([int(t)]) for t in torch.randint(0, model.config.vocab_size, (5,), generator=g)]
    batched = dec.forward(step, together)
    for s, c, b in zip(step, alone, batched):
        single = dec.forward([s], [c])[0]
        assert torch.allclose(b, single, atol=1e-5, rtol=0)


def test_bfloat16_matches_the_hf_forward_in_bfloat16(model, tmp_path):
    model.save_pretrained(tmp_path)
    bf16 = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    dec = RaggedDecoder(bf16)
    s = torch.tensor([5, 17, 300, 2, 9, 44])
    cache = KVCache()
    mine = torch.cat([dec.forward([s[:3]], [cache], all_logits=True)[0],
                      dec.forward([s[3:]], [cache], all_logits=True)[0]])
    with torch.no_grad():
        ref = bf16(s.unsqueeze(0)).logits[0]
    assert mine.dtype == torch.bfloat16
    assert torch.allclose(mine.float(), ref.float(), atol=2e-2, rtol=0)
