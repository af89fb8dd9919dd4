"""The engine's token sampler (services/engine/sampling.py): truncation, frequencies, bans, seeds, log-probs."""

from __future__ import annotations

import torch

from services.engine.sampling import SamplingParams, inverse_cdf, sample_batch


def _draws(logits: torch.Tensor, count: int, **params) -> torch.Tensor:
    """`count` tokens sampled from the same row of logits, in one batch (the shared draw)."""
    p = SamplingParams(**params)
    tokens, _, _ = sample_batch(logits.expand(count, -1).clone(), [p] * count, [None] * count, [[]] * count)
    return torch.tensor(tokens)


def test_inverse_cdf_follows_the_distribution_and_never_draws_zero_mass():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).expand(40_000, -1)
    torch.manual_seed(0)
    ids = inverse_cdf(probs, torch.rand(40_000))
    freq = torch.bincount(ids, minlength=5).float() / 40_000
    assert freq[1] == 0 and freq[4] == 0
    assert torch.allclose(freq, probs[0], atol=0.01), freq


def test_inverse_cdf_edges_land_on_tokens_with_mass():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]])
    # u = 0 takes the first token with mass; u just under 1 the last one, never the zero-mass tail
    assert inverse_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 2]
    assert inverse_cdf(probs, torch.tensor([1 - 1e-7, 1 - 1e-7])).tolist() == [2, 2]


def test_unnormalised_rows_are_drawn_by_their_share():
    probs = torch.tensor([[2.0, 6.0]]).expand(20_000, -1)
    torch.manual_seed(1)
    share = inverse_cdf(probs, torch.rand(20_000)).float().mean()
    assert abs(float(share) - 0.75) < 0.015


def test_top_k_top_p_and_min_p_keep_only_their_tokens():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]))[None]
    torch.manual_seed(2)
    assert set(_draws(logits, 4000, temperature=1.0, top_k=2).tolist()) == {0, 1}
    assert set(_draws(logits, 4000, temperature=1.0, top_p=0.75).tolist()) == {0, 1, 2}  # 0.4 + 0.3 < 0.75
    assert set(_draws(logits, 4000, temperature=1.0, min_p=0.4).tolist()) == {0, 1, 2}  # p >= 0.16
    assert set(_draws(logits, 4000, temperature=1.0, top_k=1).tolist()) == {0}


def test_sampled_frequencies_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    torch.manual_seed(3)
    tokens = _draws(logits, 30_000, temperature=2.0)
    freq = torch.bincount(tokens, minlength=3).float() / 30_000
    assert torch.allclose(freq, torch.softmax(logits[0] / 2.0, -1), atol=0.012), freq


def test_banned_tokens_are_never_drawn_and_log_probs_are_before_truncation():
    logits = torch.tensor([[3.0, 0.0, 0.0, -1.0]])
    p = SamplingParams(temperature=0.7, top_k=3)
    rows = 500
    tokens, chosen, logprobs = sample_batch(logits.expand(rows, -1).clone(), [p] * rows, [None] * rows, [[0]] * rows)
    assert 0 not in tokens
    expected = torch.log_softmax(logits[0] / 0.7, -1)
    assert torch.allclose(logprobs[0], expected)
    assert all(abs(c - float(expected[t])) < 1e-6 for t, c in zip(tokens, chosen))


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    torch.manual_seed(4)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 6

    def seeded_tokens(others_seeded: bool) -> list[int]:
        generators = [torch.Generator().manual_seed(100 + i) if i % 2 == 0 or others_seeded else None for i in range(6)]
        return sample_batch(logits, params, generators, [[]] * 6)[0]

    alone = [
        sample_batch(logits[i : i + 1], params[:1], [torch.Generator().manual_seed(100 + i)], [[]])[0][0]
        for i in range(0, 6, 2)
    ]
    for others_seeded in (False, True):
        assert seeded_tokens(others_seeded)[0::2] == alone


def test_greedy_rows_take_the_argmax_next_to_sampled_ones():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)]
    tokens, _, logprobs = sample_batch(logits, params, [None, None], [[], []])
    assert tokens == [1, 1]
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1))


def test_non_finite_logits_fail_the_draw_instead_of_sampling_garbage():
    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    try:
        sample_batch(logits, [SamplingParams(temperature=1.0)], [None], [[]])
    except ValueError as exc:
        assert "not finite" in str(exc)
    else:
        raise AssertionError("NaN logits were sampled from")
