"""The engine's batched forward over the KV pool equals the Hugging Face model's own forward."""

from __future__ import annotations

import pytest
import torch

from services.engine.batched_decoder import BatchedDecoder
from services.model.init_model import init_model
from services.engine.kv_pool import KVPool, PoolFull
from services.model.loading import load_causal_lm


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    path = init_model(str(tmp_path_factory.mktemp(request.param)), preset="tiny", arch=request.param, seed=1)
    return load_causal_lm(path)[0]


def _decoder(model, slots: int = 8, slot_len: int = 64) -> BatchedDecoder:
    cfg = model.config
    pool = KVPool(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
        slots,
        slot_len,
        dtype=next(model.parameters()).dtype,
    )
    return BatchedDecoder(model, pool)


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_mixed_prefill_chunks_and_decodes_match_full_forward(model):
    dec = _decoder(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 1, 13)]
    slots = [dec.pool.allocate() for _ in seqs]
    # step 1: chunks of two prompts and a whole third; step 2: the rest of those, joined by a fourth
    _, first = dec.forward(slots[:3], [seqs[0][:3], seqs[1][:3], seqs[2]], [True] * 3)
    _, second = dec.forward([slots[0], slots[1], slots[3]], [seqs[0][3:], seqs[1][3:], seqs[3]], [True] * 3)
    got = [torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]), first[2], second[2]]
    for s, mine in zip(seqs, got):
        ref = _hf_logits(model, s)
        assert torch.allclose(mine, ref, atol=1e-5, rtol=0), (mine - ref).abs().max()
    assert [dec.pool.lengths[s] for s in slots] == [5, 9, 1, 13]


def test_greedy_decoding_equals_transformers_generate(model):
    dec = _decoder(model)
    prompts = [[5, 17, 300, 2], [44, 9], [7]]
    slots = [dec.pool.allocate() for _ in prompts]
    out = [[] for _ in prompts]
    logits, _ = dec.forward(slots, prompts)
    for _ in range(6):  # decode every sequence together, one token each per step
        nxt = logits.argmax(-1).tolist()
        for o, t in zip(out, nxt):
            o.append(t)
        logits, _ = dec.forward(slots, [[t] for t in nxt])
    for p, o in zip(prompts, out):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ]
        assert o == ref.tolist()


def test_decodes_in_scattered_slots_match_one_by_one(model):
    """One-token steps of sequences with different cache lengths, in slots that are not consecutive (the
    keys are gathered) and in consecutive ones (a view), give each sequence's own logits."""
    dec = _decoder(model, slots=12)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (2, 7, 4, 11, 1)]
    taken = [dec.pool.allocate() for _ in range(10)]
    scattered = [taken[i] for i in (9, 1, 4, 6, 2)]
    for s in set(taken) - set(scattered):
        dec.pool.release(s)
    dec.forward(scattered, prompts)
    step = torch.randint(0, model.config.vocab_size, (5,), generator=g).tolist()
    batched, _ = dec.forward(scattered, [[t] for t in step])
    for p, t, row in zip(prompts, step, batched):
        assert torch.allclose(row, _hf_logits(model, p + [t])[-1], atol=1e-5, rtol=0)


def test_copied_prefix_continues_like_its_source(model):
    """The n samples of one prompt: the prompt's KV copied into sibling slots decodes as if prefilled there."""
    dec = _decoder(model)
    prompt = [3, 99, 250, 17, 8]
    leader, *siblings = [dec.pool.allocate() for _ in range(3)]
    dec.forward([leader], [prompt])
    dec.pool.copy_prefix(leader, siblings, len(prompt))
    nexts = [[11], [12], [13]]
    logits, _ = dec.forward([leader, *siblings], nexts)
    for row, t in zip(logits, nexts):
        assert torch.allclose(row, _hf_logits(model, prompt + t)[-1], atol=1e-5, rtol=0)


def test_pool_hands_out_every_slot_once_and_refuses_past_the_context(model):
    dec = _decoder(model, slots=2, slot_len=8)
    a, b = dec.pool.allocate(), dec.pool.allocate()
    with pytest.raises(PoolFull):
        dec.pool.allocate()
    with pytest.raises(ValueError, match="context length"):
        dec.forward([a], [list(range(9))])
    assert dec.pool.lengths[a] == 0  # a refused step writes nothing
    dec.pool.release(b)
    assert dec.pool.allocate() == b


def test_weights_loaded_into_the_hf_modules_are_used(model):
    """The fused projections are views of the HF parameters: an in-place load (what a weight sync does)
    changes what the decoder computes."""
    dec = _decoder(model)
    q = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    saved = q.detach().clone()
    try:
        with torch.no_grad():
            q.mul_(1.5)
        slot = dec.pool.allocate()
        logits, _ = dec.forward([slot], [[1, 2, 3]])
        assert torch.allclose(logits[0], _hf_logits(model, [1, 2, 3])[-1], atol=1e-5, rtol=0)
    finally:
        with torch.no_grad():
            q.copy_(saved)


def test_bfloat16_matches_the_hf_forward_in_bfloat16(model, tmp_path):
    # an earlier test's decoder left the parameters as (transposed) views of its fused weights
    model.save_pretrained(tmp_path, state_dict={k: v.contiguous() for k, v in model.state_dict().items()})
    bf16 = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    dec = _decoder(bf16)
    s = [5, 17, 300, 2, 9, 44]
    slot = dec.pool.allocate()
    _, a = dec.forward([slot], [s[:3]], [True])
    _, b = dec.forward([slot], [s[3:]], [True])
    mine = torch.cat([a[0], b[0]])
    ref = _hf_logits(bf16, s)
    assert mine.dtype == torch.bfloat16
    assert torch.allclose(mine.float(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_short_inputs_and_decodes_in_one_step_match_full_forward(model, tmp_path, dtype):
    """The three kinds of input a step mixes: prompt chunks longer than SHORT_INPUT (fused attention),
    several tokens of one sequence (a decode token and its drafts) and single decode tokens (batched matmuls)."""
    from services.engine.batched_decoder import SHORT_INPUT

    if dtype != torch.float32:  # an earlier test's decoder left the parameters as views of its fused weights
        model.save_pretrained(tmp_path, state_dict={k: v.contiguous() for k, v in model.state_dict().items()})
        model = type(model).from_pretrained(tmp_path, dtype=dtype).eval()
    dec = _decoder(model, slot_len=160)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (90, 50, 21, 8)]
    slots = [dec.pool.allocate() for _ in seqs]
    # step 1: long chunks of the first two, whole prompts of the others
    _, first = dec.forward(slots, [seqs[0][: SHORT_INPUT + 20], seqs[1][:45], seqs[2][:20], seqs[3][:7]], [True] * 4)
    # step 2: a long chunk, a 5-token input, a single token, a single token
    _, second = dec.forward(slots, [seqs[0][SHORT_INPUT + 20 :], seqs[1][45:], seqs[2][20:], seqs[3][7:]], [True] * 4)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for i, s in enumerate(seqs):
        mine = torch.cat([first[i], second[i]]).float()
        ref = _hf_logits(model, s).float()
        assert torch.allclose(mine, ref, atol=tolerance, rtol=0), (i, (mine - ref).abs().max())


def test_rows_nobody_reads_skip_the_last_layer_but_leave_their_keys(model):
    """Prompt chunks without full logits run their last layer's attention and MLP on their last token only
    (the other rows' outputs are never read): the last-token logits, the full logits of the sequence that
    asks for them, and the next decode step (which reads every row's last-layer keys) equal the HF forward."""
    from services.engine.batched_decoder import SHORT_INPUT

    dec = _decoder(model, slot_len=160)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (80, 40, 12, 30)]
    prompts = [s[:-1] for s in seqs]
    slots = [dec.pool.allocate() for _ in seqs]
    assert len(prompts[0]) > SHORT_INPUT
    read = dec._read_rows(
        slots,
        [0] * 4,
        [len(p) for p in prompts],
        [79, 118, 129, 158],
        torch.zeros(158, dtype=torch.long),
        [False, False, False, True],
    )
    assert read[2] == [1, 1, 1, 29]  # the rows read: one per prompt, all of the one asking for full logits
    last, full = dec.forward(slots, prompts, [False, False, False, True])
    for i, p in enumerate(prompts):
        assert torch.allclose(last[i], _hf_logits(model, p)[-1], atol=1e-5, rtol=0)
    assert torch.allclose(full[3], _hf_logits(model, prompts[3]), atol=1e-5, rtol=0) and list(full) == [3]
    step, _ = dec.forward(slots, [[s[-1]] for s in seqs])
    for i, s in enumerate(seqs):
        assert torch.allclose(step[i], _hf_logits(model, s)[-1], atol=1e-5, rtol=0)
