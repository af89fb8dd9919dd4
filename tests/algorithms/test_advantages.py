"""Advantage estimators against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from services.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)

T = torch.tensor
H = 1 / math.sqrt(2)  # 0.5 / sqrt(0.5): a group [1, 0] with unbiased std sqrt(0.5)


def close(got, want, atol=1e-5):
    want = torch.as_tensor(want, dtype=got.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, atol=atol, rtol=0), (got, want)


# --- outcome estimators: GRPO, Dr.GRPO, RLOO ---------------------------------------------------


def test_grpo_groups_of_two_and_four():
    # groups [1, 0] and [0, 1]: mean 0.5, unbiased std sqrt(0.25 + 0.25) = 0.7071 -> +-0.7071
    close(grpo_advantages(T([1.0, 0.0, 0.0, 1.0]), 2), [H, -H, -H, H])
    # [1, 0, 0, 0]: mean 0.25, unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
    close(grpo_advantages(T([1.0, 0.0, 0.0, 0.0]), 4), [1.5, -0.5, -0.5, -0.5])


def test_grpo_integer_rewards_and_eps():
    # 0/1 verifier rewards as ints; eps=1 is visible: 0.5 / (0.7071 + 1)
    close(grpo_advantages(T([1, 0]), 2, eps=1.0), [0.5 / (H + 1), -0.5 / (H + 1)])


def test_dr_grpo_subtracts_the_group_mean_only():
    close(dr_grpo_advantages(T([1.0, 0.0, 0.0, 0.0]), 4), [0.75, -0.25, -0.25, -0.25])
    close(dr_grpo_advantages(T([3.0, 1.0, 2.0, 2.0]), 2), [1.0, -1.0, 0.0, 0.0])


def test_rloo_leaves_the_sample_out():
    # 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3
    close(rloo_advantages(T([1.0, 0.0, 0.0, 0.0]), 4), [1.0, -1 / 3, -1 / 3, -1 / 3])
    close(rloo_advantages(T([3.0, 1.0, 5.0, 5.0]), 2), [2.0, -2.0, 0.0, 0.0])


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_outcome_estimators_edge_cases(fn):
    # a group of one has nothing to compare against; equal rewards carry no signal
    close(fn(T([1.0, 0.0, 3.0]), 1), [0.0, 0.0, 0.0])
    close(fn(T([0.7, 0.7, 0.7, 1.0, 1.0, 1.0]), 3), [0.0] * 6)
    with pytest.raises(ValueError, match="does not divide"):
        fn(T([1.0, 0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="group_size"):
        fn(T([1.0, 0.0]), 0)
    with pytest.raises(ValueError, match="1-D"):
        fn(T([[1.0, 0.0]]), 2)


# --- per-token rewards and returns --------------------------------------------------------------

MASK = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_token_rewards_put_the_reward_last_and_the_kl_penalty_everywhere():
    kl = T([[0.1, 0.2, 0.3, 9.0], [0.5, 0.5, 9.0, 9.0]])  # 9.0 on padding must not show up
    got = token_rewards(T([1.0, 2.0]), MASK, kl, kl_coef=0.5)
    # row 0: -0.05, -0.1, -0.15 + 1; row 1: -0.25, -0.25 + 2
    close(got, [[-0.05, -0.1, 0.85, 0.0], [-0.25, 1.75, 0.0, 0.0]])
    close(token_rewards(T([1.0, 2.0]), MASK), [[0, 0, 1.0, 0], [0, 2.0, 0, 0]])


def test_token_rewards_last_token_is_the_last_masked_in_one():
    # interior masked-out token at t=2; a fully masked row keeps nothing
    mask = T([[1.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    close(token_rewards(T([3.0, 5.0]), mask), [[0, 0, 0, 3.0, 0], [0, 0, 0, 0, 0]])
    # a bool mask works the same
    close(token_rewards(T([3.0, 5.0]), mask.bool()), [[0, 0, 0, 3.0, 0], [0, 0, 0, 0, 0]])


def test_discounted_returns_by_hand():
    r = T([[-0.05, -0.1, 0.85, 7.0], [-0.25, 1.75, 7.0, 7.0]])  # 7.0 on padding is ignored
    # gamma 0.5: row 0: G2 = 0.85, G1 = -0.1 + 0.425 = 0.325, G0 = -0.05 + 0.1625 = 0.1125
    #            row 1: G1 = 1.75, G0 = -0.25 + 0.875 = 0.625
    close(discounted_returns(r, MASK, 0.5), [[0.1125, 0.325, 0.85, 0.0], [0.625, 1.75, 0.0, 0.0]])
    close(discounted_returns(r, MASK, 1.0), [[0.7, 0.75, 0.85, 0.0], [1.5, 1.75, 0.0, 0.0]])


def test_discounted_returns_pass_over_masked_out_tokens():
    # t=1 is masked out (e.g. tool output): no reward, no discount step, 0 in the result
    got = discounted_returns(T([[0.0, 5.0, 1.0]]), T([[1.0, 0.0, 1.0]]), 0.5)
    close(got, [[0.5, 0.0, 1.0]])


# --- REINFORCE++ --------------------------------------------------------------------------------


def test_reinforce_pp_whitens_returns_over_all_masked_tokens():
    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    adv, ret = reinforce_pp_advantages(T([1.0, 0.0, 0.0, 1.0]), mask, group_size=2)
    close(ret, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    # masked returns 1, 1, 0, 0, 0, 1: mean 0.5, population std 0.5 -> +-1
    close(adv, [[1.0, 1.0], [-1.0, 0.0], [-1.0, -1.0], [1.0, 0.0]])


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    mask = torch.ones(4, 1)
    adv, ret = reinforce_pp_advantages(T([1.0, 0.0, 0.0, 0.0]), mask, group_size=2, baseline=True)
    # r' = [0.5, -0.5, 0, 0]: mean 0, population var 0.5 / 4 = 0.125, std 0.35355
    close(ret, [[0.5], [-0.5], [0.0], [0.0]])
    close(adv, [[math.sqrt(2)], [-math.sqrt(2)], [0.0], [0.0]])


def test_reinforce_pp_with_kl_penalty_and_discount():
    mask = T([[1.0, 1.0], [1.0, 1.0]])
    kl = T([[0.2, 0.4], [0.0, 0.2]])
    _, ret = reinforce_pp_advantages(T([1.0, 0.0]), mask, 2, kl=kl, kl_coef=0.5, gamma=0.5)
    # token rewards [[-0.1, 0.8], [0, -0.1]] -> G = [[-0.1 + 0.4, 0.8], [-0.05, -0.1]]
    close(ret, [[0.3, 0.8], [-0.05, -0.1]])


def test_reinforce_pp_equal_rewards_give_zero_advantages():
    adv, _ = reinforce_pp_advantages(T([1.0, 1.0]), T([[1.0, 0.0], [1.0, 1.0]]), 2)
    close(adv, [[0.0, 0.0], [0.0, 0.0]])


# --- GAE ----------------------------------------------------------------------------------------


def test_gae_by_hand_gamma_09_lam_08():
    r = T([[0.0, 0.0, 1.0, 4.0]])
    v = T([[0.5, 0.4, 0.6, 3.0]])  # position 3 is padding: its value is never read
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.8)
    # delta2 = 1 - 0.6 = 0.4; delta1 = 0.9 * 0.6 - 0.4 = 0.14; delta0 = 0.9 * 0.4 - 0.5 = -0.14
    # A2 = 0.4; A1 = 0.14 + 0.72 * 0.4 = 0.428; A0 = -0.14 + 0.72 * 0.428 = 0.16816
    close(adv, [[0.16816, 0.428, 0.4, 0.0]])
    close(ret, [[0.66816, 0.828, 1.0, 0.0]])


def test_gae_with_lambda_one_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t; the return target is that sum
    r = T([[0.0, 0.5, 2.0, 0.0], [1.0, -1.0, 0.0, 0.0]])
    v = T([[0.3, 0.1, 1.5, 9.0], [0.2, 0.7, 9.0, 9.0]])
    adv, ret = gae_advantages(r, v, MASK, gamma=1.0, lam=1.0)
    close(ret, [[2.5, 2.5, 2.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    close(adv, [[2.2, 2.4, 0.5, 0.0], [-0.2, -1.7, 0.0, 0.0]])
    # with lam = 1 and any gamma, the target equals the discounted return
    _, ret_09 = gae_advantages(r, v, MASK, gamma=0.9, lam=1.0)
    close(ret_09, discounted_returns(r, MASK, 0.9))


def test_gae_lambda_zero_is_the_td_error():
    adv, _ = gae_advantages(T([[0.0, 1.0]]), T([[0.5, 0.2]]), T([[1.0, 1.0]]), gamma=0.5, lam=0.0)
    # delta0 = 0 + 0.5 * 0.2 - 0.5 = -0.4; delta1 = 1 - 0.2 = 0.8
    close(adv, [[-0.4, 0.8]])


def test_gae_passes_over_masked_out_tokens():
    # t=1 masked out: t=0 bootstraps from V at t=2, one discount step
    adv, _ = gae_advantages(T([[0.0, 9.0, 1.0]]), T([[0.5, 9.0, 0.2]]), T([[1.0, 0.0, 1.0]]), 0.5, 0.5)
    # delta2 = 1 - 0.2 = 0.8; delta0 = 0.5 * 0.2 - 0.5 = -0.4; A0 = -0.4 + 0.25 * 0.8 = -0.2
    close(adv, [[-0.2, 0.0, 0.8]])


def test_whiten_uses_the_population_std_over_masked_entries():
    got = whiten(T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]]))
    # mean 2, var 2/3, std 0.8165
    close(got, [[-1.2247449, 0.0, 1.2247449, 0.0]])
    close(whiten(T([[4.0, 4.0]]), T([[1.0, 1.0]])), [[0.0, 0.0]])
    close(whiten(T([[4.0, 4.0]]), T([[0.0, 0.0]])), [[0.0, 0.0]])


# --- dispatch -----------------------------------------------------------------------------------


def test_compute_advantages_broadcasts_outcome_advantages_over_masked_tokens():
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = T([1.0, 0.0, 0.0, 0.0])
    adv, ret = compute_advantages("grpo", rewards, mask, 2)
    close(adv, [[H, H, 0], [-H, 0, 0], [0, 0, 0], [0, 0, 0]])
    close(ret, adv)
    adv, _ = compute_advantages("rloo", rewards, mask, 4)
    close(adv, [[1, 1, 0], [-1 / 3, 0, 0], [-1 / 3, -1 / 3, -1 / 3], [-1 / 3, -1 / 3, 0]])


def test_compute_advantages_kl_is_a_reward_penalty_for_outcome_estimators():
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kl = T([[0.2, 0.2, 5.0], [0.2, 5.0, 5.0]])
    # penalised rewards: 1 - 0.5 * 0.4 = 0.8, 0 - 0.5 * 0.2 = -0.1; mean 0.35
    adv, _ = compute_advantages("dr_grpo", T([1.0, 0.0]), mask, 2, kl=kl, kl_coef=0.5)
    close(adv, [[0.45, 0.45, 0.0], [-0.45, 0.0, 0.0]])
    # kl given but kl_coef 0: no penalty
    adv, _ = compute_advantages("dr_grpo", T([1.0, 0.0]), mask, 2, kl=kl)
    close(adv, [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]])


def test_compute_advantages_of_episodes_written_as_several_rows_counts_each_episode_once():
    # two episodes of one group, each written as 2 rows (its chains; the second of episode 1 is padding, mask 0)
    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    rewards = T([1.0, 1.0, 0.0, 0.0])
    adv, _ = compute_advantages("grpo", rewards, mask, 2, copies=2)  # the group [1, 0]: +-H
    close(adv, [[H, H], [H, 0], [-H, 0], [0, 0]])
    adv, _ = compute_advantages("rloo", rewards, mask, 2, copies=2)  # leave-one-out over episodes: +-1
    close(adv, [[1, 1], [1, 0], [-1, 0], [0, 0]])
    # the KL penalty is the episode's, summed over its rows: 1 - 0.5 * (0.4 + 0.2) = 0.7 and 0 - 0.5 * 0.2 = -0.1
    kl = T([[0.2, 0.2], [0.2, 9.0], [0.2, 9.0], [9.0, 9.0]])
    adv, _ = compute_advantages("dr_grpo", rewards, mask, 2, kl=kl, kl_coef=0.5, copies=2)
    close(adv, [[0.4, 0.4], [0.4, 0], [-0.4, 0], [0, 0]])
    with pytest.raises(ValueError, match="copies"):
        compute_advantages("grpo", rewards[:3], mask[:3], 1, copies=2)


def test_compute_advantages_reinforce_pp_variants():
    mask = torch.ones(4, 1)
    adv, _ = compute_advantages("reinforce_pp_baseline", T([1.0, 0.0, 0.0, 0.0]), mask, 2)
    close(adv, [[math.sqrt(2)], [-math.sqrt(2)], [0.0], [0.0]])
    adv, ret = compute_advantages("reinforce_pp", T([1.0, 0.0, 0.0, 1.0]), mask, 2)
    close(ret, [[1.0], [0.0], [0.0], [1.0]])
    close(adv, [[1.0], [-1.0], [-1.0], [1.0]])


def test_compute_advantages_ppo_whitens_advantages_not_returns():
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    values = T([[0.5, 0.5], [0.0, 7.0]])
    kl = T([[0.0, 1.0], [0.0, 0.0]])
    adv, ret = compute_advantages("ppo", T([1.0, 0.0]), mask, 1, values=values, kl=kl, kl_coef=0.5, gamma=1.0, lam=1.0)
    # token rewards [[0, 1 - 0.5], [0, pad]]; returns [[0.5, 0.5], [0, 0]]; raw A = [[0, 0], [0, pad]]
    close(ret, [[0.5, 0.5], [0.0, 0.0]])
    close(adv, [[0.0, 0.0], [0.0, 0.0]])
    values = T([[0.0, 0.0], [0.0, 0.0]])
    adv, ret = compute_advantages("ppo", T([3.0, 0.0]), mask, 2, values=values)
    # raw A = returns = [[3, 3], [0, pad]]: mean 2, population std sqrt(2) -> [0.7071, 0.7071, -1.4142]
    close(ret, [[3.0, 3.0], [0.0, 0.0]])
    close(adv, [[H, H], [-math.sqrt(2), 0.0]])


def test_compute_advantages_bad_arguments():
    mask = torch.ones(2, 3)
    r = T([1.0, 0.0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'gpro'"):
        compute_advantages("gpro", r, mask, 2)
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages("ppo", r, mask, 2)
    with pytest.raises(ValueError, match="does not divide"):
        compute_advantages("grpo", T([1.0, 0.0, 1.0]), torch.ones(3, 3), 2)
    with pytest.raises(ValueError, match="does not divide"):
        compute_advantages("reinforce_pp", T([1.0, 0.0, 1.0]), torch.ones(3, 3), 2)
    with pytest.raises(ValueError, match=r"rewards must have shape \[2\]"):
        compute_advantages("grpo", T([1.0, 0.0, 1.0]), mask, 1)
    with pytest.raises(ValueError, match="mask must be 2-D"):
        compute_advantages("grpo", r, torch.ones(2), 2)
    with pytest.raises(ValueError, match="values must have the mask's shape"):
        compute_advantages("ppo", r, mask, 2, values=torch.ones(2, 4))
    with pytest.raises(ValueError, match="needs the per-token kl"):
        compute_advantages("grpo", r, mask, 2, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl must have the mask's shape"):
        compute_advantages("reinforce_pp", r, mask, 2, kl=torch.ones(2, 2), kl_coef=0.1)
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_advantages("ppo", r, mask, 2, values=torch.ones(2, 3), gamma=1.5)
    assert set(ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_keeps_padding_zero(estimator):
    mask = T([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    garbage = torch.full((4, 4), float("nan")).where(mask == 0, torch.tensor(0.3))
    adv, ret = compute_advantages(
        estimator, T([1.0, 0.0, 0.5, 2.0]), mask, 2, values=garbage, kl=garbage, kl_coef=0.1, gamma=0.9, lam=0.95
    )
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    assert (adv[mask == 1] != 0).any()
