"""One optimizer step of the actor over a global batch of samples, split into micro batches.

The loss terms are services/algorithms/policy_loss.py; the aggregation totals (tokens, sequences)
are those of the whole global batch, so the accumulated gradient equals one pass over it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from services.algorithms.policy_loss import PolicyLossConfig, log_probs_and_entropy, policy_loss
from services.run_contract.run_config import RunConfig
from services.model.response_batch import ResponseBatch, response_logits
from services.model.shared_prompt_batch import build_response_batch
from services.trainer.precision import autocast
from services.transferqueue.codec import Batch


def loss_config(run: RunConfig) -> PolicyLossConfig:
    a = run.algorithm
    kl_loss = a.kl_coef if (a.kl_coef > 0 and not a.kl_in_reward) else 0.0
    return PolicyLossConfig(
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        dual_clip_c=a.dual_clip_c,
        tis_clip=a.tis_clip,
        behav_cap=a.behav_weight_cap,
        behav_floor=a.behav_weight_floor,
        loss_agg=a.loss_agg,
        kl_loss_coef=kl_loss,
        kl_loss_kind=a.kl_kind,
        entropy_coef=a.entropy_coef,
    )


def pad(values, width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def micro_batches(batch: Batch, micro_batch_size: int, device: str, hidden_size: int | None = None):
    """(slice, responses, loss mask [B, T]) for each micro batch of a global batch. With the model's
    `hidden_size`, samples that share a prompt are packed when that is cheaper
    (services/model/shared_prompt_batch.py); without it every sample is its own padded row (ResponseBatch)."""
    for start in range(0, len(batch.rows), micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        parts = batch["tokens"][sl], batch["prompt_length"][sl], batch["response_length"][sl]
        rb = build_response_batch(*parts, hidden_size=hidden_size) if hidden_size else ResponseBatch.build(*parts)
        rb = rb.to_device(device)
        yield sl, rb, pad(batch["loss_mask"][sl], rb.mask.shape[1]).to(device)


@dataclass
class StepMetrics:
    """Sums over micro batches, token-weighted where the metric is per token."""

    sums: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    loss: float = 0.0
    grad_norm: float = 0.0

    def add(self, metrics: dict, tokens: float) -> None:
        for name, value in metrics.items():
            if name in ("tokens", "ratio_max"):
                continue
            self.sums[name] = self.sums.get(name, 0.0) + float(value) * tokens
        self.sums["ratio_max"] = max(self.sums.get("ratio_max", 0.0), float(metrics.get("ratio_max", 0.0)))
        self.tokens += tokens

    def means(self) -> dict[str, float]:
        out = {k: (v if k == "ratio_max" else v / max(self.tokens, 1.0)) for k, v in self.sums.items()}
        out.update(loss=self.loss, grad_norm=self.grad_norm, tokens=self.tokens)
        return out


def micro_batch_loss(
    logits: torch.Tensor,
    rb,
    mask: torch.Tensor,
    batch: Batch,
    sl: slice,
    run: RunConfig,
    totals: tuple[float, float],
    device: str = "cpu",
) -> tuple[torch.Tensor, dict, float]:
    """(loss, metrics, tokens) of one micro batch from its response logits `[B, T, V]` (already divided by the
    sampling temperature): the policy loss of services/algorithms/policy_loss.py with the global batch's
    `totals` (tokens, sequences), and how far the trainer's policy is from the one that sampled."""
    cfg = loss_config(run)
    width = rb.mask.shape[1]
    rollout = pad(batch["rollout_log_probs"][sl], width).to(device)
    old = pad(batch["log_probs"][sl], width).to(device) if run.uses_actor_fwd else rollout
    ref = pad(batch["ref_log_probs"][sl], width).to(device) if cfg.kl_loss_coef > 0 else None
    advantages = pad(batch["advantages"][sl], width).to(device)
    log_probs, entropy = log_probs_and_entropy(logits, rb.response_ids, entropy_grad=cfg.entropy_coef > 0)
    loss, m = policy_loss(
        log_probs,
        old,
        advantages,
        mask,
        cfg,
        rollout_log_probs=rollout if run.uses_actor_fwd else None,
        ref_log_probs=ref,
        entropy=entropy,
        total_tokens=totals[0],
        total_seqs=totals[1],
    )
    tokens = float(mask.sum())
    with torch.no_grad():  # before this update
        diff = (log_probs.detach() - rollout) * mask
        m = {
            **m,
            "rollout_logprob_abs_diff": diff.abs().sum() / max(tokens, 1.0),
            "rollout_kl_k3": ((torch.exp(-diff) - 1 + diff) * mask).sum() / max(tokens, 1.0),
        }
    return loss, m, tokens


def global_totals(batch: Batch, totals: tuple[float, float] | None) -> tuple[float, float]:
    masks = batch["loss_mask"]
    # a row with no token to train (one that pads an agent episode's chains) is not a sequence of the loss
    return totals or (
        float(sum(float(m.sum()) for m in masks)),
        float(max(1, sum(1 for m in masks if float(m.sum()) > 0))),
    )


def actor_step(
    model,
    optimizer,
    batch: Batch,
    run: RunConfig,
    micro_batch_size: int,
    device: str = "cpu",
    totals: tuple[float, float] | None = None,
    reduce_gradients=None,
    last_micro_batch=None,
    precision: str = "fp32",
) -> StepMetrics:
    """One optimizer step over `batch`. With data parallelism `batch` is this rank's share, `totals`
    the (tokens, sequences) of the whole global batch and `reduce_gradients(params)` sums the ranks'
    gradients before clipping. `model`: a causal LM, or the ResponseLogits a trainer backend trains
    (services/trainer/backend.py). `last_micro_batch(is_last)` is called before each backward (FSDP syncs
    gradients on the last only). `precision` bf16-mixed runs the forward under bfloat16 autocast (the
    backward follows its casts; the loss is float32: services/trainer/precision.py)."""
    totals = global_totals(batch, totals)
    metrics = StepMetrics()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    count = -(-len(batch.rows) // micro_batch_size)
    for k, (sl, rb, mask) in enumerate(micro_batches(batch, micro_batch_size, device, model.config.hidden_size)):
        with autocast(precision, device):  # the forward only: autocast's backward runs in the forward's dtypes
            logits = response_logits(model, rb, run.rollout.temperature)
        loss, m, tokens = micro_batch_loss(logits, rb, mask, batch, sl, run, totals, device)
        if last_micro_batch is not None:
            last_micro_batch(k == count - 1)
        loss.backward()
        metrics.add(m, tokens)
        metrics.loss += float(loss.detach())
    if reduce_gradients is not None:
        reduce_gradients([p for p in model.parameters() if p.requires_grad])
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.optim.grad_clip)
    metrics.grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
    if math.isfinite(metrics.grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return metrics


def loss_totals(batch, run: RunConfig, dp, data_size: int) -> tuple[float, float]:
    """The global batch's (tokens, sequences) the loss is normalised by (services/algorithms/policy_loss.py:
    aggregate), from every rank's share (`dp`: the data-parallel group; `data_size`: the backend's model
    replicas): the ranks of one replica (megatron: TP x PP) hold the same rows, so they are counted once; rows
    that pad an agent episode's chains train on nothing and count for nothing."""
    replica = dp.size // data_size
    masks = batch["loss_mask"]
    tokens = dp.total(float(sum(float(m.sum()) for m in masks))) / replica
    if run.chains_per_episode == 1:
        return tokens, float(run.global_batch_size)
    return tokens, max(1.0, dp.total(float(sum(1 for m in masks if float(m.sum()) > 0))) / replica)
