"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ (± baseline) and PPO's GAE.

Conventions. `rewards` is one scalar per sample, shape [B]. Per-token tensors are response-aligned and
padded, shape [B, T]; `mask` [B, T] is 1 on response tokens that count, 0 on padding and masked-out
tokens (bool or float both work). Rows of one prompt group are contiguous: with group size n, rows
[g*n, (g+1)*n) are group g. Every per-token result is 0 wherever the mask is 0, and values under the mask's
zeros (padding) are never read, so they may hold anything.

Masked-out tokens inside a response (for example tool output in a multi-turn sample) are not steps of the
policy: they add no reward and do not discount, so a return or GAE recursion passes over them unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.algorithms.names import ESTIMATORS


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage (Shao et al. 2024, "DeepSeekMath", section 4.1.2):

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    std is the unbiased sample std (Bessel's correction, `torch.std`'s default), as verl computes it.
    A group of one sample has no spread to compare against: its advantage is 0. A group whose rewards are
    all equal gets 0 too (0 / eps).
    """
    groups = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(groups).view(-1)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)


def dr_grpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"):

        A_i = r_i - mean(r_group)

    Dividing by the group std (GRPO) up-weights prompts that are almost always solved or almost always
    failed; Dr.GRPO drops it. (Its other half, no per-response length normalisation, is the loss
    aggregation `seq_mean_token_sum` in `policy_loss.aggregate`.)
    """
    groups = _grouped(rewards, group_size)
    return (groups - groups.mean(dim=1, keepdim=True)).view(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO, REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs"):

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j

    The baseline leaves the sample itself out, so it is independent of r_i and the estimate is unbiased.
    With n == 1 there is no other sample: the advantage is 0.
    """
    groups = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(groups).view(-1)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).view(-1)


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token reward [B, T]: the sequence reward on the last masked-in token, a KL penalty on every one.

        r_t = -kl_coef * kl_t + [t == last masked-in token] * r

    `kl` is a per-token KL estimate against the reference policy (see `policy_loss.kl_estimate`); it is
    used only when `kl_coef` != 0. A row with no masked-in token has nowhere to receive its reward and
    stays all 0.
    """
    B, T = _check_mask(mask)
    rewards = _check_rewards(rewards, B)
    on = mask > 0
    out = torch.zeros((B, T), dtype=rewards.dtype, device=rewards.device)
    if kl_coef != 0:
        if kl is None:
            raise ValueError(f"kl_coef={kl_coef} needs the per-token kl tensor")
        _check_like(kl, mask, "kl")
        out = torch.where(on, -kl_coef * kl.to(out.dtype), out)
    if T == 0:
        return out
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(on, positions, -1).amax(dim=1)
    has = last >= 0
    rows = torch.arange(B, device=mask.device)[has]
    reward_at_end = torch.zeros_like(out).index_put((rows, last[has]), rewards[has])
    return out + reward_at_end


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Discounted reward-to-go [B, T] over masked-in tokens:

        G_t = r_t + gamma * G_{t+1}        (t, t+1 consecutive masked-in tokens; G after the last one = 0)

    i.e. G_t = sum_{t' >= t} gamma^k(t, t') r_t' with k counting masked-in steps from t to t'. Masked-out
    tokens contribute nothing and are 0 in the result.
    """
    _check_mask(mask)
    _check_like(token_rewards, mask, "token_rewards")
    _check_unit_interval(gamma, "gamma")
    on = mask > 0
    rewards = torch.where(on, token_rewards, 0.0)
    running = torch.zeros_like(rewards[:, 0]) if rewards.shape[1] else None
    out = []
    for t in reversed(range(rewards.shape[1])):
        assert running is not None  # None only for zero tokens, when this loop never runs
        # a masked-out token leaves the running return alone: it is not a step of the policy
        running = torch.where(on[:, t], rewards[:, t] + gamma * running, running)
        out.append(torch.where(on[:, t], running, 0.0))
    return torch.stack(out[::-1], dim=1) if out else torch.zeros_like(rewards)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    baseline: bool = False,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models"); returns (advantages, returns), both [B, T]:

        r'_i      = r_i                       (REINFORCE++)
                  = r_i - mean(r_group)       (REINFORCE++-baseline)
        G         = discounted_returns(token_rewards(r', mask, kl, kl_coef), mask, gamma)
        A         = whiten(G, mask)           (mean/std over every masked-in token of the batch)

    Whitening over the whole batch, not per prompt, is what separates it from GRPO: the normalisation
    does not over-fit to a group of a few samples. "The batch" is whatever the caller passes.
    """
    B, _ = _check_mask(mask)
    rewards = _check_rewards(rewards, B)
    if baseline:
        rewards = dr_grpo_advantages(rewards, group_size)
    else:
        _grouped(rewards, group_size)  # same argument checks either way
    returns = discounted_returns(token_rewards(rewards, mask, kl, kl_coef), mask, gamma)
    return whiten(returns, mask, eps), returns


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation"); returns (advantages, returns), both [B, T], not whitened:

        delta_t = r_t + gamma * V_{t+1} - V_t       (V after the last masked-in token = 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                         (the value target)

    t+1 is the next masked-in token. With lam = 1, A_t = G_t - V_t (`discounted_returns`).
    """
    _check_mask(mask)
    _check_like(token_rewards, mask, "token_rewards")
    _check_like(values, mask, "values")
    _check_unit_interval(gamma, "gamma")
    _check_unit_interval(lam, "lam")
    on = mask > 0
    rewards = torch.where(on, token_rewards, 0.0)
    values = torch.where(on, values, 0.0)
    next_value = torch.zeros_like(values[:, 0]) if values.shape[1] else None
    next_advantage = next_value
    out = []
    for t in reversed(range(values.shape[1])):
        assert next_value is not None and next_advantage is not None  # None only for zero tokens: no iteration
        advantage = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        # a masked-out token is not a step: carry the next step's value and advantage past it
        next_value = torch.where(on[:, t], values[:, t], next_value)
        next_advantage = torch.where(on[:, t], advantage, next_advantage)
        out.append(torch.where(on[:, t], advantage, 0.0))
    advantages = torch.stack(out[::-1], dim=1) if out else torch.zeros_like(values)
    return advantages, torch.where(on, advantages + values, 0.0)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Normalise x to mean 0, std 1 over its masked-in entries (PPO's advantage normalisation):

        x' = (x - mean) / sqrt(var + eps)

    with the population variance over masked-in entries (as OpenRLHF, where REINFORCE++ comes from).
    Masked-out entries are 0 in the result; all-equal entries give 0.
    """
    _check_mask(mask)
    _check_like(x, mask, "x")
    on = mask > 0
    x = torch.where(on, x, 0.0)
    count = on.sum().clamp(min=1)
    mean = x.sum() / count
    var = torch.where(on, (x - mean) ** 2, 0.0).sum() / count
    return torch.where(on, (x - mean) * torch.rsqrt(var + eps), 0.0)


def compute_advantages(
    estimator: str,
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    values: Tensor | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    copies: int = 1,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns), both [B, T], for `estimator` in ESTIMATORS.

    `copies`: rows per sample. An agent episode is written as `copies` consecutive rows (its chains, which share
    its reward; services/rollout/episodes.py), so a group is group_size x copies rows, and the statistics of
    the outcome estimators are the episodes' (each counted once), as AReaL does for an episode's chains.

    - grpo, dr_grpo, rloo: one advantage per sample, on every masked-in token of each of its rows; returns =
      advantages. With kl and kl_coef, the KL is a reward penalty first: r_i - kl_coef * sum_t(mask * kl)_i
      (summed over all of a sample's rows). gamma, lam and values are not used.
    - reinforce_pp, reinforce_pp_baseline: `reinforce_pp_advantages` (KL penalty per token).
    - ppo: per-token rewards with the KL penalty, `gae_advantages` with the critic's `values`;
      advantages whitened over the batch, returns (the critic's targets) not.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")
    B, _ = _check_mask(mask)
    rewards = _check_rewards(rewards, B)
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1 or B % copies:
        raise ValueError(f"copies must be a positive int dividing the batch of {B} rows, got {copies!r}")
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):  # token-level: each row is a sample of the group
        return reinforce_pp_advantages(
            rewards, mask, group_size * copies, kl, kl_coef, gamma, baseline=estimator == "reinforce_pp_baseline"
        )
    if estimator == "ppo":
        if values is None:
            raise ValueError("the ppo estimator needs the critic's values [B, T]")
        _grouped(rewards, group_size * copies)
        advantages, returns = gae_advantages(token_rewards(rewards, mask, kl, kl_coef), values, mask, gamma, lam)
        return whiten(advantages, mask), returns

    on = mask > 0
    if kl_coef != 0:
        if kl is None:
            raise ValueError(f"kl_coef={kl_coef} needs the per-token kl tensor")
        _check_like(kl, mask, "kl")
        penalty = torch.where(on, kl.to(rewards.dtype), 0.0).sum(dim=1)
        rewards = rewards - kl_coef * penalty.view(-1, copies).sum(dim=1).repeat_interleave(copies)
    outcome = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}[estimator]
    per_sample = outcome(rewards.view(-1, copies)[:, 0].contiguous(), group_size).repeat_interleave(copies)
    advantages = torch.where(on, per_sample[:, None], 0.0)
    return advantages, advantages.clone()


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """rewards [B] as [B / group_size, group_size], floating point."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"group_size {group_size} does not divide the batch of {rewards.shape[0]} rewards")
    return _floating(rewards).view(-1, group_size)


def _check_rewards(rewards: Tensor, batch: int) -> Tensor:
    if rewards.dim() != 1 or rewards.shape[0] != batch:
        raise ValueError(f"rewards must have shape [{batch}] (one per row of mask), got {tuple(rewards.shape)}")
    return _floating(rewards)


def _check_mask(mask: Tensor) -> tuple[int, int]:
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    return mask.shape[0], mask.shape[1]


def _check_like(x: Tensor, mask: Tensor, name: str) -> None:
    if x.shape != mask.shape:
        raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(x.shape)}")


def _check_unit_interval(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _floating(x: Tensor) -> Tensor:
    # integer rewards (0/1 verifiers) would make every mean and division integer arithmetic
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())
