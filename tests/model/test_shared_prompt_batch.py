"""Samples that share a prompt packed into one row give the padded batch's logits and gradients."""

import pytest
import torch

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.response_batch import ResponseBatch, response_log_probs, response_logits, token_log_probs
from services.model.shared_prompt_batch import SharedPromptBatch, build_response_batch


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(tmp_path_factory, request):
    torch.set_num_threads(1)
    directory = init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch=request.param, seed=5)
    model, _ = load_causal_lm(directory)
    return model


def _samples(seed: int = 0):
    """Two groups of 4 interleaved (not contiguous), responses of 1-9 tokens, and one prompt of its own."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 200, (n,), generator=g) for n in (11, 7, 5)]
    order = [0, 1, 0, 1, 1, 0, 2, 0, 1]
    tokens = [
        torch.cat([prompts[k], torch.randint(4, 200, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g)])
        for k in order
    ]
    prompt_lengths = [len(prompts[k]) for k in order]
    return tokens, prompt_lengths, [len(t) - p for t, p in zip(tokens, prompt_lengths)]


def test_packed_logits_equal_the_padded_batch(model):
    tokens, pls, rls = _samples()
    padded = ResponseBatch.build(tokens, pls, rls)
    packed = build_response_batch(tokens, pls, rls, hidden_size=model.config.hidden_size)
    assert isinstance(packed, SharedPromptBatch)
    assert packed.input_ids.shape[0] == 3 and packed.token_count == 11 + 7 + 5 + sum(rls)
    with torch.no_grad():
        want, got = response_logits(model, padded, 0.7), response_logits(model, packed, 0.7)
    mask = padded.mask.bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    assert torch.equal(packed.response_ids, padded.response_ids) and torch.equal(packed.mask, padded.mask)
    lp = response_log_probs(model, packed)
    assert [len(x) for x in packed.to_ragged(lp)] == rls and torch.all(lp[~mask] == 0)


def test_packed_gradients_equal_the_padded_batch(model):
    tokens, pls, rls = _samples(1)
    weights = torch.randn(len(tokens), max(rls), generator=torch.Generator().manual_seed(2))

    def grads(batch):
        model.zero_grad(set_to_none=True)
        loss = (token_log_probs(response_logits(model, batch), batch.response_ids) * batch.mask * weights).sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(
        grads(ResponseBatch.build(tokens, pls, rls)),
        grads(build_response_batch(tokens, pls, rls, hidden_size=model.config.hidden_size)),
    ):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    model.zero_grad(set_to_none=True)


def test_packing_only_when_it_pays():
    one = torch.arange(4, 24)
    # nothing shared: the padded layout
    distinct = [torch.cat([one + k, torch.tensor([5, 6])]) for k in range(4)]
    assert isinstance(build_response_batch(distinct, [20] * 4, [2] * 4, hidden_size=64), ResponseBatch)
    # short answers to a long shared prompt: packed
    short = [torch.cat([one, torch.tensor([5, 6])]) for _ in range(4)]
    assert isinstance(build_response_batch(short, [20] * 4, [2] * 4, hidden_size=64), SharedPromptBatch)
    # long answers to a short shared prompt: one packed row of ~8x the length costs more attention than it saves
    long = [torch.cat([one[:2], torch.arange(4, 404)]) for _ in range(8)]
    assert isinstance(build_response_batch(long, [2] * 8, [400] * 8, hidden_size=64), ResponseBatch)
