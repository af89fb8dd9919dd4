"""The trainer's optimizer: AdamW (decoupled weight decay; Loshchilov & Hutter, 2019), one kernel per step.

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr (m_hat / (sqrt(v_hat) + eps) + wd p)        (m_hat, v_hat: bias-corrected)

torch's fused implementation does this for every parameter in one kernel where the device has one (CPU and
CUDA): 2.1 ms instead of 12.5 ms a step for the demo's 3.4M-parameter model on one CPU thread, the same
update and the same state dict (checkpoints load either way)."""

from __future__ import annotations

import math

import torch

FUSED_DEVICES = ("cpu", "cuda")


def adamw(parameters, lr: float, betas: tuple[float, float], weight_decay: float, device: str) -> torch.optim.AdamW:
    fused = torch.device(device).type in FUSED_DEVICES
    return torch.optim.AdamW(parameters, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)


def lr_factor(step: int, num_steps: int, schedule: str, warmup_steps: int = 0, min_ratio: float = 0.0) -> float:
    """The learning rate of step `step` (0-based) of `num_steps`, as a fraction of the configured lr; the
    schedules of TRL/transformers' `get_scheduler` and verl's, here per training step:

        warm-up (step < W):   (step + 1) / W
        then, with t = (step - W) / max(num_steps - W - 1, 1) in [0, 1] and r = min_ratio:
          constant            1
          linear              r + (1 - r) (1 - t)
          cosine              r + (1 - r) (1 + cos(pi t)) / 2           (Loshchilov & Hutter, SGDR, 2017)

    so decay starts at 1 right after the warm-up and reaches r at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    t = min(max((step - warmup_steps) / max(num_steps - warmup_steps - 1, 1), 0.0), 1.0)
    if schedule == "linear":
        return min_ratio + (1 - min_ratio) * (1 - t)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * t)) / 2
    raise ValueError(f"unknown learning rate schedule {schedule!r}")


def set_lr(optimizer: torch.optim.Optimizer, base_lr: float, step: int, optim, num_steps: int) -> float:
    """Set every parameter group's lr for `step` (run config `optim`: lr_schedule, warmup_steps, min_lr_ratio);
    returns it. Set per step from the step index, so a resumed trainer needs no scheduler state."""
    lr = base_lr * lr_factor(step, num_steps, optim.lr_schedule, optim.warmup_steps, optim.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
