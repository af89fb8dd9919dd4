"""Loss terms of the actor (clipped policy gradient with off-policy corrections, KL, entropy) and of the
critic (clipped value loss), and how per-token terms are reduced to one scalar.

Per-token tensors are [B, T], response-aligned and padded, with `mask` [B, T] (1 = token counts in the
loss). Entries under the mask's zeros are never used, so padding may hold anything (even inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.algorithms.names import AGGREGATIONS, KL_KINDS

# exp() of a log-ratio beyond this overflows float32 towards inf; e^20 is far outside any clip range
_MAX_LOG_RATIO = 20.0


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman 2020, "Approximating KL
    Divergence", http://joschu.net/blog/kl-approx.html). With x = log pi(t) - log ref(t):

        k1 = x                      unbiased, high variance, can be negative
        k2 = x^2 / 2                biased (low for small x), low variance, >= 0
        k3 = exp(-x) - 1 + x        unbiased, low variance, >= 0 (GRPO's KL loss)
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} "
            "must have the same shape"
        )
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1 + log_ratio


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, [B, T, V] -> [B, T]:

        H = -sum_v p_v log p_v,  log p = log_softmax(logits)

    log_softmax subtracts the logsumexp, so large logits do not overflow; -inf logits (masked vocabulary)
    add 0, not nan, to the value and to the gradient.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V > 0, got shape {tuple(logits.shape)}")
    log_p = torch.log_softmax(logits, dim=-1)
    # p = 0 where log p = -inf: clamping keeps 0 * log p finite, and clamp passes no gradient there
    finite_log_p = log_p.clamp(min=torch.finfo(log_p.dtype).min)
    return -(log_p.exp() * finite_log_p).sum(dim=-1)


def log_probs_and_entropy(logits: Tensor, token_ids: Tensor, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """log p(token) [B, T] and the entropy H [B, T] of softmax(logits) [B, T, V], from one log-softmax
    (entropy_from_logits and a separate logsumexp would each pass over the vocabulary again). With
    entropy_grad False the entropy is a metric only: computed without building its graph."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.gather(log_p, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        source = log_p if entropy_grad else log_p.detach()
        entropy = -(source.exp() * source.clamp(min=torch.finfo(source.dtype).min)).sum(dim=-1)
    return picked, entropy


def aggregate(
    values: Tensor, mask: Tensor, mode: str, total_tokens: float | None = None, total_seqs: float | None = None
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar:

        token_mean           sum_{i,t} v m / total_tokens                       (default: mask.sum())
        seq_mean_token_mean  sum_i [ sum_t v m / max(1, sum_t m) ] / total_seqs  (default: B)
        seq_mean_token_sum   sum_i sum_t v m / total_seqs                       (default: B)

    token_mean weighs every token alike (DAPO's token-level loss); seq_mean_token_mean is the original
    GRPO (each response alike, long responses' tokens count less); seq_mean_token_sum is Dr.GRPO's
    (no length normalisation). Pass the *global* batch's totals when a batch is split into micro batches:
    the micro-batch losses then sum to exactly the whole batch's loss, and so do their gradients.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
    _check_per_token(mask, values=values)
    on = mask > 0
    masked = torch.where(on, values, 0.0)
    if mode == "token_mean":
        total = _total(total_tokens, "total_tokens", on.sum().clamp(min=1))
        return masked.sum() / total
    total = _total(total_seqs, "total_seqs", max(1, mask.shape[0]))
    per_seq = masked.sum(dim=1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / on.sum(dim=1).clamp(min=1)
    return per_seq.sum() / total


@dataclass
class PolicyLossConfig:
    """Knobs of `policy_loss`; the names are the run config's.

    eps_clip       PPO clip range below 1: ratio >= 1 - eps_clip (and above 1 when eps_clip_high is None)
    eps_clip_high  clip range above 1 (DAPO's clip-higher); None = eps_clip
    dual_clip_c    dual-clip bound for negative advantages, > 1; None = off
    tis_clip       cap of the behaviour importance weight (truncated importance sampling); None = no cap
    behav_cap      tokens whose behaviour weight exceeds this leave the policy term (AReaL's filter); None = off
    behav_floor    tokens whose behaviour weight is below this leave it too; None = off
    loss_agg       one of AGGREGATIONS
    kl_loss_coef   weight of the KL(pi || ref) loss term; 0 = off
    kl_loss_kind   one of KL_KINDS
    entropy_coef   weight of the entropy bonus; 0 = off
    """

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip_c: float | None = None
    tis_clip: float | None = None
    behav_cap: float | None = None
    behav_floor: float | None = None
    loss_agg: str = "token_mean"
    kl_loss_coef: float = 0.0
    kl_loss_kind: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_clip < 1.0:
            raise ValueError(f"eps_clip must be in [0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high < 0:
            raise ValueError(f"eps_clip_high must be >= 0 (or None), got {self.eps_clip_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (or None), got {self.dual_clip_c}")
        if self.tis_clip is not None and not self.tis_clip > 0:
            raise ValueError(f"tis_clip must be > 0 (or None), got {self.tis_clip}")
        if self.behav_cap is not None and not self.behav_cap > 1:
            raise ValueError(f"behav_cap must be > 1 (or None), got {self.behav_cap}")
        if self.behav_floor is not None and not 0 < self.behav_floor < 1:
            raise ValueError(f"behav_floor must be in (0, 1) (or None), got {self.behav_floor}")
        if self.loss_agg not in AGGREGATIONS:
            raise ValueError(f"unknown loss_agg {self.loss_agg!r}; expected one of {AGGREGATIONS}")
        if self.kl_loss_coef < 0:
            raise ValueError(f"kl_loss_coef must be >= 0, got {self.kl_loss_coef}")
        if self.kl_loss_kind not in KL_KINDS:
            raise ValueError(f"unknown kl_loss_kind {self.kl_loss_kind!r}; expected one of {KL_KINDS}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    rollout_log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's loss, a scalar, and its metrics.

    Clipped surrogate (PPO, Schulman et al. 2017, "Proximal Policy Optimization Algorithms"), with
    clip-higher (DAPO, Yu et al. 2025: eps_high > eps_low lets low-probability tokens grow, against
    entropy collapse):

        ratio_t = exp(log pi(t) - log pi_old(t))
        pg_t    = max(-A_t ratio_t, -A_t clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high))

    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning"): for A_t < 0 the term above grows without bound with the ratio; cap it:

        pg_t = min(pg_t, -A_t c)                                   where A_t < 0

    Off-policy correction. `old_log_probs` is the proximal policy pi_old the clip is centred on: actor_fwd's
    log-probs for decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization", as
    AReaL uses it, Fu et al. 2025), otherwise the rollout log-probs. When `rollout_log_probs` (the
    behaviour policy mu that sampled the tokens) is given, each token is reweighted by

        w_t = pi_old(t) / mu(t)                (detached; = 1 when they are the same)
        w_t = 0  where w_t > behav_cap or w_t < behav_floor
                                               the token leaves the policy term: AReaL's behaviour
                                               importance-weight filter (its behav_imp_weight_cap / _floor;
                                               Fu et al. 2025): a token whose probability moved far between
                                               the behaviour and the proximal policy would carry a weight
                                               that dominates the batch's gradient (or one near 0)
        w_t = min(w_t, tis_clip)               when tis_clip is set: truncated importance sampling (Yao
                                               et al. 2025, "Your Efficient RL Framework Secretly Brings
                                               You Off-Policy RL Training")
        pg_t = w_t pg_t

    KL loss: kl_loss_coef * kl_estimate(log pi, log ref, kl_loss_kind). Entropy bonus: -entropy_coef * H_t.
    Every term is reduced with `aggregate(., mask, cfg.loss_agg, total_tokens, total_seqs)`:

        loss = pg + kl_loss_coef * kl - entropy_coef * entropy

    Metrics are detached scalars, token means over this call's mask (weight them by "tokens" to combine
    micro batches): pg_loss, clip_fraction (tokens where the clipped branch is the max), dual_clip_fraction,
    approx_kl (mean of (log pi - log pi_old)^2 / 2), ratio_max (a max, not a mean), tokens; kl when
    ref_log_probs is given, entropy when entropy is given, tis_weight_mean and behav_filtered_fraction (tokens the
    filter took out) when rollout_log_probs is given.

    Log-ratios beyond +-20 are clamped before exp() so a wild token cannot overflow to inf; such a ratio
    is clipped (or dual-clipped) anyway for every sane clip range.
    """
    _check_per_token(
        mask,
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        rollout_log_probs=rollout_log_probs,
        ref_log_probs=ref_log_probs,
        entropy=entropy,
    )
    if cfg.kl_loss_coef > 0 and ref_log_probs is None:
        raise ValueError(f"kl_loss_coef={cfg.kl_loss_coef} needs ref_log_probs")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs the per-token entropy")
    on = mask > 0
    # padding may hold garbage (-inf log-probs, nan advantages): zero it before it meets exp() or a product
    log_probs = torch.where(on, log_probs, 0.0)
    old_log_probs = torch.where(on, old_log_probs, 0.0)
    advantages = torch.where(on, advantages, 0.0)

    def agg(per_token: Tensor) -> Tensor:
        return aggregate(per_token, mask, cfg.loss_agg, total_tokens, total_seqs)

    log_ratio = log_probs - old_log_probs
    pg, ratio, clip_taken, dual_taken = _clipped_surrogate(log_ratio, advantages, on, cfg)

    metrics: dict[str, Tensor] = {}
    if rollout_log_probs is not None:
        weight, metrics = _behaviour_weight(old_log_probs, torch.where(on, rollout_log_probs, 0.0), on, cfg)
        pg = pg * weight

    loss = agg(pg)
    metrics["pg_loss"] = _token_mean(pg, on)
    metrics["clip_fraction"] = _token_mean(clip_taken, on)
    metrics["dual_clip_fraction"] = _token_mean(dual_taken, on)
    metrics["approx_kl"] = _token_mean(0.5 * log_ratio**2, on)
    metrics["ratio_max"] = torch.where(on, ratio, 0.0).max().detach() if on.any() else ratio.new_zeros(())
    if ref_log_probs is not None:
        kl = kl_estimate(log_probs, torch.where(on, ref_log_probs, 0.0), cfg.kl_loss_kind)
        metrics["kl"] = _token_mean(kl, on)
        if cfg.kl_loss_coef > 0:
            loss = loss + cfg.kl_loss_coef * agg(kl)
    if entropy is not None:
        metrics["entropy"] = _token_mean(entropy, on)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * agg(entropy)
    metrics["tokens"] = on.sum().to(ratio.dtype)
    return loss, metrics


def _clipped_surrogate(
    log_ratio: Tensor, advantages: Tensor, on: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """pg_t of policy_loss's docstring before the behaviour weight: the clipped surrogate (with clip-higher) and,
    when dual_clip_c is set, the dual clip, from log_ratio = log pi - log pi_old:

        ratio_t = exp(clamp(log_ratio_t, -20, 20))
        pg_t    = max(-A_t ratio_t, -A_t clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high))
        pg_t    = min(pg_t, -A_t c)                                where A_t < 0

    Returns (pg, ratio, clip_taken, dual_taken): the last two mark the tokens under `on` where the clipped
    branch, or the dual-clip bound, is the one taken."""
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + eps_high)
    pg = torch.maximum(unclipped, clipped)
    clip_taken = on & (clipped > unclipped)
    dual_taken = torch.zeros_like(on)
    if cfg.dual_clip_c is not None:
        bound = -advantages * cfg.dual_clip_c
        dual_taken = on & (advantages < 0) & (pg > bound)
        pg = torch.where(dual_taken, bound, pg)
    return pg, ratio, clip_taken, dual_taken


def _behaviour_weight(
    old_log_probs: Tensor, rollout_log_probs: Tensor, on: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """w_t of policy_loss's docstring (filtered, then truncated) and its metrics."""
    weight = torch.exp((old_log_probs - rollout_log_probs).detach().clamp(max=_MAX_LOG_RATIO))
    kept = on
    if cfg.behav_cap is not None:
        kept = kept & (weight <= cfg.behav_cap)
    if cfg.behav_floor is not None:
        kept = kept & (weight >= cfg.behav_floor)
    weight = torch.where(kept, weight, 0.0)
    if cfg.tis_clip is not None:
        weight = weight.clamp(max=cfg.tis_clip)
    return weight, {"behav_filtered_fraction": _token_mean(on & ~kept, on), "tis_weight_mean": _token_mean(weight, on)}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = None,
    loss_agg: str = "token_mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's loss (PPO, Schulman et al. 2017; value clipping as in OpenAI baselines' PPO2):

        L_t = 0.5 * max((V_t - R_t)^2, (V_old,t + clip(V_t - V_old,t, -clip, clip) - R_t)^2)
        L_t = 0.5 * (V_t - R_t)^2                                   when clip is None

    reduced with `aggregate(., mask, loss_agg, total_tokens, total_seqs)`. Clipping keeps one update from
    moving the value estimate far from the one the advantages were computed with. Metrics (detached token
    means): value_loss, value_clip_fraction (tokens where the clipped term is the max), tokens.
    """
    _check_per_token(mask, values=values, old_values=old_values, returns=returns)
    if clip is not None and clip < 0:
        raise ValueError(f"value clip must be >= 0 (or None), got {clip}")
    on = mask > 0
    values = torch.where(on, values, 0.0)
    returns = torch.where(on, returns, 0.0)
    unclipped = (values - returns) ** 2
    per_token = unclipped
    clip_taken = torch.zeros_like(on)
    if clip is not None:
        old_values = torch.where(on, old_values, 0.0)
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clip_taken = on & (clipped > unclipped)
    per_token = 0.5 * per_token
    loss = aggregate(per_token, mask, loss_agg, total_tokens, total_seqs)
    metrics = {
        "value_loss": _token_mean(per_token, on),
        "value_clip_fraction": _token_mean(clip_taken, on),
        "tokens": on.sum().to(per_token.dtype),
    }
    return loss, metrics


def _token_mean(values: Tensor, on: Tensor) -> Tensor:
    values = values.detach()
    if not values.is_floating_point():  # the clip indicators are bool
        values = values.to(torch.get_default_dtype())
    return torch.where(on, values, 0.0).sum() / on.sum().clamp(min=1)


def _total(given: float | None, name: str, default) -> float | Tensor:
    if given is None:
        return default
    if not given > 0:
        raise ValueError(f"{name} must be > 0, got {given}")
    return given


def _check_per_token(mask: Tensor, **tensors: Tensor | None) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    for name, x in tensors.items():
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(x.shape)}")
