"""Loss terms against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from services.algorithms.policy_loss import (
    AGGREGATIONS,
    PolicyLossConfig,
    aggregate,
    entropy_from_logits,
    kl_estimate,
    policy_loss,
    value_loss,
)

T = torch.tensor
LN = math.log
INF = float("inf")
NAN = float("nan")


def close(got, want, atol=1e-5):
    want = torch.as_tensor(want, dtype=got.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, atol=atol, rtol=0), (got, want)


def ratios_as_log_probs(ratios):
    """log_probs (requiring grad) and old_log_probs whose ratio is `ratios`."""
    old = torch.full((1, len(ratios)), -1.0)
    log_probs = (old + torch.log(T([ratios]))).requires_grad_()
    return log_probs, old


# --- clipped surrogate --------------------------------------------------------------------------


def test_clipped_and_unclipped_tokens():
    log_probs, old = ratios_as_log_probs([1.1, 1.5, 0.5, 1.5, 1.0])
    # the fifth token is padding and holds garbage: inf log-prob, nan advantage
    log_probs_padded = torch.cat([log_probs[:, :4], T([[INF]])], dim=1)
    adv = T([[2.0, 1.0, -1.0, -1.0, NAN]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, m = policy_loss(log_probs_padded, old, adv, mask, PolicyLossConfig(eps_clip=0.2))
    # A=2 r=1.1: -2.2 (inside the range); A=1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped);
    # A=-1 r=0.5: max(0.5, 0.8) = 0.8 (clipped); A=-1 r=1.5: max(1.5, 1.2) = 1.5 (unclipped)
    close(loss, (-2.2 - 1.2 + 0.8 + 1.5) / 4)
    close(m["pg_loss"], -0.275)
    close(m["clip_fraction"], 0.5)
    close(m["dual_clip_fraction"], 0.0)
    close(m["ratio_max"], 1.5)
    close(m["tokens"], 4.0)
    # mean of (ln r)^2 / 2 over ln 1.1, ln 1.5, ln 0.5, ln 1.5
    close(m["approx_kl"], 0.102292619)
    loss.backward()
    # d/d log pi of -A r is -A r on unclipped tokens; clipped tokens get no gradient
    close(log_probs.grad, [[-2.2 / 4, 0.0, 0.0, 1.5 / 4, 0.0]])
    assert all(not v.requires_grad for v in m.values())


def test_dual_clip_caps_negative_advantage_terms():
    log_probs, old = ratios_as_log_probs([5.0, 2.0, 5.0])
    adv = T([[-1.0, -1.0, 1.0]])
    cfg = PolicyLossConfig(eps_clip=0.2, dual_clip_c=3.0)
    loss, m = policy_loss(log_probs, old, adv, torch.ones(1, 3), cfg)
    # A=-1 r=5: max(5, 1.2) = 5 -> min(5, 3) = 3; A=-1 r=2: 2 < 3 stays;
    # A=1 r=5: max(-5, -1.2) = -1.2, dual clip does not touch positive advantages
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(m["dual_clip_fraction"], 1 / 3)
    close(m["clip_fraction"], 1 / 3)
    loss.backward()
    close(log_probs.grad, [[0.0, 2.0 / 3, 0.0]])
    # without dual clip the first token costs 5
    loss, _ = policy_loss(log_probs, old, adv, torch.ones(1, 3), PolicyLossConfig(eps_clip=0.2))
    close(loss, (5.0 + 2.0 - 1.2) / 3)


def test_eps_clip_high_widens_only_the_upper_side():
    log_probs, old = ratios_as_log_probs([1.25, 1.3, 0.7])
    adv = T([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, m = policy_loss(log_probs, old, adv, mask, PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28))
    # r=1.25 < 1.28: -1.25; r=1.3 -> -1.28; r=0.7 (A<0) still clipped at 0.8
    close(loss, (-1.25 - 1.28 + 0.8) / 3)
    close(m["clip_fraction"], 2 / 3)
    loss, m = policy_loss(log_probs, old, adv, mask, PolicyLossConfig(eps_clip=0.2))
    close(loss, (-1.2 - 1.2 + 0.8) / 3)
    close(m["clip_fraction"], 1.0)


# --- off-policy corrections ---------------------------------------------------------------------


def test_decoupled_behaviour_weight_and_its_tis_cap():
    log_probs, old = ratios_as_log_probs([1.0, 1.0])
    rollout = old - torch.log(T([[3.0, 0.5]]))  # pi_old / mu = 3 and 0.5
    adv = T([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, m = policy_loss(log_probs, old, adv, mask, PolicyLossConfig(), rollout_log_probs=rollout)
    # decoupled PPO, uncapped: pg = -1 * w = [-3, -0.5]
    close(loss, -1.75)
    close(m["tis_weight_mean"], 1.75)
    loss.backward()
    close(log_probs.grad, [[-1.5, -0.25]])  # the weight is a constant: -A r w / 2

    log_probs.grad = None
    loss, m = policy_loss(log_probs, old, adv, mask, PolicyLossConfig(tis_clip=2.0), rollout_log_probs=rollout)
    # w = min(w, 2) = [2, 0.5]
    close(loss, -1.25)
    close(m["tis_weight_mean"], 1.25)
    loss.backward()
    close(log_probs.grad, [[-1.0, -0.25]])


def test_areal_behaviour_weight_filter_drops_tokens_outside_cap_and_floor():
    """AReaL's decoupled loss (behav_imp_weight_cap / _floor): a token whose behaviour weight pi_old / mu is above
    the cap or below the floor leaves the policy term (weight 0), the others keep their whole weight; the mean is
    still over every token of the mask."""
    log_probs, old = ratios_as_log_probs([1.0, 1.0, 1.0, 1.0])
    rollout = old - torch.log(T([[6.0, 4.0, 0.5, 0.1]]))  # w = 6, 4, 0.5, 0.1
    adv, mask = T([[1.0, 1.0, -2.0, 1.0]]), torch.ones(1, 4)
    cfg = PolicyLossConfig(behav_cap=5.0, behav_floor=0.2)
    loss, m = policy_loss(log_probs, old, adv, mask, cfg, rollout_log_probs=rollout)
    # kept: w = 4 (pg = -1 * 4) and w = 0.5 (pg = 2 * 0.5); dropped: 6 (> cap) and 0.1 (< floor)
    close(loss, (-4.0 + 1.0) / 4)
    close(m["behav_filtered_fraction"], 0.5)
    close(m["tis_weight_mean"], (4.0 + 0.5) / 4)
    loss.backward()
    close(log_probs.grad, [[0.0, -1.0, 0.25, 0.0]])  # -A r w / 4 on the kept tokens, nothing on the others

    log_probs.grad = None  # the filter, then the truncation: 4 -> 2
    loss, _ = policy_loss(
        log_probs, old, adv, mask, PolicyLossConfig(behav_cap=5.0, tis_clip=2.0), rollout_log_probs=rollout
    )
    close(loss, (-2.0 + 1.0 - 0.1) / 4)


def test_clip_is_centred_on_the_proximal_policy():
    log_probs, old = ratios_as_log_probs([1.5])
    rollout = old - LN(2.0)
    loss, m = policy_loss(
        log_probs, old, T([[1.0]]), torch.ones(1, 1), PolicyLossConfig(eps_clip=0.2), rollout_log_probs=rollout
    )
    # ratio against pi_old is 1.5 -> clipped to 1.2; behaviour weight 2: -1.2 * 2
    close(loss, -2.4)
    close(m["clip_fraction"], 1.0)


def test_rollout_log_probs_equal_to_old_change_nothing():
    log_probs, old = ratios_as_log_probs([1.1, 0.9])
    adv, mask = T([[1.0, -0.5]]), torch.ones(1, 2)
    plain, _ = policy_loss(log_probs, old, adv, mask, PolicyLossConfig())
    same, m = policy_loss(log_probs, old, adv, mask, PolicyLossConfig(tis_clip=2.0), rollout_log_probs=old)
    close(same, plain.item())
    close(m["tis_weight_mean"], 1.0)


# --- KL and entropy -----------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    log_probs = T([-1.0, -1.5, -2.0])
    ref = T([-1.5, -1.0, -2.0])  # log ratio 0.5, -0.5, 0
    close(kl_estimate(log_probs, ref, "k1"), [0.5, -0.5, 0.0])
    close(kl_estimate(log_probs, ref, "k2"), [0.125, 0.125, 0.0])
    # exp(-0.5) - 1 + 0.5 = 0.1065307; exp(0.5) - 1 - 0.5 = 0.1487213
    close(kl_estimate(log_probs, ref, "k3"), [0.10653066, 0.14872127, 0.0])


def test_kl_loss_term():
    log_probs, old = ratios_as_log_probs([1.0, 1.0])
    ref = old - T([[0.5, -0.5]])
    adv, mask = torch.zeros(1, 2), torch.ones(1, 2)  # no policy-gradient term
    for kind, kl in [("k1", 0.0), ("k2", 0.125), ("k3", 0.1276259652)]:
        loss, m = policy_loss(
            log_probs, old, adv, mask, PolicyLossConfig(kl_loss_coef=0.1, kl_loss_kind=kind), ref_log_probs=ref
        )
        close(loss, 0.1 * kl)
        close(m["kl"], kl)
    # ref given, coefficient 0: monitored, not in the loss
    loss, m = policy_loss(log_probs, old, adv, mask, PolicyLossConfig(kl_loss_kind="k2"), ref_log_probs=ref)
    close(loss, 0.0)
    close(m["kl"], 0.125)


def test_entropy_bonus():
    log_probs, old = ratios_as_log_probs([1.0, 1.0, 1.0])
    entropy = T([[1.0, 2.0, NAN]])
    mask = T([[1.0, 1.0, 0.0]])
    loss, m = policy_loss(log_probs, old, torch.zeros(1, 3), mask, PolicyLossConfig(entropy_coef=0.01), entropy=entropy)
    close(loss, -0.01 * 1.5)
    close(m["entropy"], 1.5)


def test_entropy_from_logits():
    # uniform over V: log V
    close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), LN(7)))
    # p = [1/4, 3/4]: 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351
    close(entropy_from_logits(T([[[0.0, LN(3)]]])), [[0.5623351446]])
    # a masked vocabulary entry (-inf) adds nothing and no nan; huge logits do not overflow
    logits = T([[[0.0, LN(3), -INF], [1000.0, 1000.0, -INF]]], requires_grad=True)
    got = entropy_from_logits(logits)
    close(got, [[0.5623351446, LN(2)]])
    got.sum().backward()
    assert torch.isfinite(logits.grad).all()


# --- aggregation --------------------------------------------------------------------------------


def test_aggregate_modes_by_hand():
    values = T([[1.0, 2.0, 3.0], [4.0, NAN, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    close(aggregate(values, mask, "token_mean"), 10 / 4)
    close(aggregate(values, mask, "seq_mean_token_mean"), (6 / 3 + 4 / 1) / 2)
    close(aggregate(values, mask, "seq_mean_token_sum"), (6 + 4) / 2)
    close(aggregate(values, mask, "token_mean", total_tokens=8), 10 / 8)
    close(aggregate(values, mask, "seq_mean_token_sum", total_seqs=5), 10 / 5)
    # a row with no tokens counts as a sequence with mean 0
    close(aggregate(values, T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), "seq_mean_token_mean"), 2 / 2)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_sum_to_the_whole_batch(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=g, requires_grad=True)
    mask = T(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]],
        dtype=torch.float32,
    )
    whole = aggregate(values, mask, mode)
    (whole_grad,) = torch.autograd.grad(whole, values)
    totals = dict(total_tokens=mask.sum().item(), total_seqs=6)
    parts = [aggregate(values[:2], mask[:2], mode, **totals), aggregate(values[2:], mask[2:], mode, **totals)]
    (parts_grad,) = torch.autograd.grad(sum(parts), values)
    assert torch.allclose(sum(parts), whole, atol=1e-6)
    assert torch.allclose(parts_grad, whole_grad, atol=1e-7)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_policy_loss_over_micro_batches_equals_the_whole_batch(mode):
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=g) * 3
    log_probs = (old + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_()
    ref = old + 0.1 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    cfg = PolicyLossConfig(loss_agg=mode, kl_loss_coef=0.05, dual_clip_c=3.0)
    whole, _ = policy_loss(log_probs, old, adv, mask, cfg, ref_log_probs=ref)
    totals = dict(total_tokens=mask.sum().item(), total_seqs=4)
    parts = sum(
        policy_loss(log_probs[s], old[s], adv[s], mask[s], cfg, ref_log_probs=ref[s], **totals)[0]
        for s in (slice(0, 1), slice(1, 4))
    )
    assert torch.allclose(parts, whole, atol=1e-6)


# --- value loss ---------------------------------------------------------------------------------


def test_value_loss_clipped_and_plain():
    values = T([[1.0, 2.0, NAN]], requires_grad=True)
    old = T([[0.5, 2.0, NAN]])
    returns = T([[2.0, 2.5, NAN]])
    mask = T([[1.0, 1.0, 0.0]])
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    # token 0: (1 - 2)^2 = 1 vs (0.5 + 0.2 - 2)^2 = 1.69 -> 0.845 (clipped); token 1: 0.5 * 0.25 = 0.125
    close(loss, (0.845 + 0.125) / 2)
    close(m["value_clip_fraction"], 0.5)
    loss.backward()
    close(values.grad, [[0.0, (2.0 - 2.5) / 2, 0.0]])  # the clipped term is flat in V
    loss, m = value_loss(values, old, returns, mask)
    close(loss, 0.5 * (1.0 + 0.25) / 2)
    close(m["value_clip_fraction"], 0.0)
    loss, _ = value_loss(values, old, returns, mask, loss_agg="seq_mean_token_sum")
    close(loss, 0.5 * (1.0 + 0.25))


# --- bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(eps_clip=1.0), "eps_clip must be"),
        (dict(eps_clip=-0.1), "eps_clip must be"),
        (dict(eps_clip_high=-0.1), "eps_clip_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c must be > 1"),
        (dict(tis_clip=0.0), "tis_clip"),
        (dict(behav_cap=1.0), "behav_cap must be > 1"),
        (dict(behav_floor=1.0), "behav_floor must be in"),
        (dict(loss_agg="mean"), "unknown loss_agg 'mean'"),
        (dict(kl_loss_coef=-1.0), "kl_loss_coef"),
        (dict(kl_loss_kind="k4"), "unknown kl_loss_kind 'k4'"),
        (dict(entropy_coef=-0.1), "entropy_coef"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


def test_bad_arguments():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs ref_log_probs"):
        policy_loss(x, x, x, mask, PolicyLossConfig(kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        policy_loss(x, x, x, mask, PolicyLossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match=r"advantages must have the mask's shape \(2, 3\)"):
        policy_loss(x, x, torch.zeros(2), mask, PolicyLossConfig())
    with pytest.raises(ValueError, match="rollout_log_probs must have"):
        policy_loss(x, x, x, mask, PolicyLossConfig(), rollout_log_probs=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="mask must be 2-D"):
        policy_loss(x, x, x, torch.ones(6), PolicyLossConfig())
    with pytest.raises(ValueError, match="unknown KL estimator 'kl'"):
        kl_estimate(x, x, "kl")
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(x, torch.zeros(3), "k1")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate(x, mask, "sum")
    with pytest.raises(ValueError, match="total_tokens must be > 0"):
        aggregate(x, mask, "token_mean", total_tokens=0)
    with pytest.raises(ValueError, match="value clip"):
        value_loss(x, x, x, mask, clip=-1.0)
    with pytest.raises(ValueError, match="returns must have"):
        value_loss(x, x, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="V > 0"):
        entropy_from_logits(torch.zeros(2, 3, 0))


def test_log_probs_and_entropy_from_one_log_softmax_equal_the_separate_functions():
    from services.algorithms.policy_loss import log_probs_and_entropy
    from services.model.response_batch import token_log_probs

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    picked, entropy = log_probs_and_entropy(logits, ids, entropy_grad=True)
    torch.testing.assert_close(picked, token_log_probs(logits, ids))
    torch.testing.assert_close(entropy, entropy_from_logits(logits))
    (picked.sum() + entropy.sum()).backward()
    ours = logits.grad.clone()
    logits.grad = None
    (token_log_probs(logits, ids).sum() + entropy_from_logits(logits).sum()).backward()
    torch.testing.assert_close(ours, logits.grad)
    _, metric_only = log_probs_and_entropy(logits, ids, entropy_grad=False)
    assert not metric_only.requires_grad  # a metric: no graph built for it
