"""The trainer's numeric precision (`--precision`); TF32 on CUDA (`--tf32`) is services/trainer/device.py.

    fp32        float32 weights, gradients, AdamW state and compute: the reference, and the default
    bf16-mixed  float32 master weights, gradients and AdamW state; the forward (and so its backward) runs under
                torch.autocast(bfloat16): matmuls in bfloat16, reductions and the loss in float32
    bf16        the weights themselves in bfloat16, so their gradients and AdamW moments too: half the memory
                of the weights, gradients and optimizer state (what slime and verl users pick to fit a larger
                model), at the cost of updates smaller than bfloat16's resolution being lost

Whatever the precision, the loss reads float32 log-probs: the logits are cast to float32 before the temperature
and the log-softmax (services/model/response_batch.py: response_logits), as verl and slime do: bfloat16 keeps
8 bits of mantissa, so a log-prob near -5 would be rounded by up to 0.016, the size of the policy changes the
PPO ratios measure.

With fsdp, bf16-mixed is FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (what
--fsdp-param-dtype bfloat16 sets); megatron trains in float32 only here.
"""

from __future__ import annotations

import contextlib

# torch is imported where it is used: the trainer's config (and so `sluice trainer --help`) imports this module
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
PRECISION_PATTERN = "^(fp32|bf16-mixed|bf16)$"


def weights_dtype(precision: str) -> str:
    """The dtype the trained model's weights are loaded in (and kept, and checkpointed in)."""
    _known(precision)
    return "bfloat16" if precision == "bf16" else "float32"


def autocast(precision: str, device: str):
    """The context the forward runs in: bfloat16 autocast for bf16-mixed (CPU too), nothing otherwise."""
    if _known(precision) != "bf16-mixed":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def fsdp_compute_dtype(precision: str, fsdp_param_dtype: str) -> str:
    """FSDP2's param_dtype (empty: none) for `--precision` with `--fsdp-param-dtype`; ValueError when the two
    contradict (bf16-mixed or bf16 asked to compute in float16)."""
    _known(precision)
    if precision == "fp32":
        return fsdp_param_dtype
    if fsdp_param_dtype not in ("", "bfloat16"):
        raise ValueError(
            f"--precision {precision} computes in bfloat16 but --fsdp-param-dtype is {fsdp_param_dtype}: "
            "leave --fsdp-param-dtype empty (or bfloat16), or use --precision fp32"
        )
    # bf16-mixed: float32 master shards, bfloat16 compute; bf16: the shards are bfloat16 already, and the
    # policy (when asked for) only keeps the gradients' reduction in float32
    return "bfloat16" if precision == "bf16-mixed" else fsdp_param_dtype


def check_precision(backend: str, precision: str, fsdp_param_dtype: str = "") -> None:
    """ValueError, naming the flags, for a precision the backend does not train in."""
    _known(precision)
    if backend == "megatron" and precision != "fp32":
        raise ValueError(
            f"--precision {precision}: the megatron backend trains in float32 only (its bfloat16 "
            "path needs megatron's mixed-precision optimizer, not wired here); use --precision fp32, "
            "or --backend torch or fsdp"
        )
    if backend == "fsdp":
        fsdp_compute_dtype(precision, fsdp_param_dtype)


def _known(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown --precision {precision!r}: one of {', '.join(PRECISIONS)}")
    return precision
