"""The precision contract of a weight sync: what dtype floating tensors travel in, and how a receiver loads them.

The trainer keeps its master weights in its own dtype (float32, or bfloat16 where asked); each receiver declares
the dtype it serves (an engine in its model info, actor_fwd and reference in their registration). A publish sends
every floating tensor in the dtype its receivers declared, cast on the trainer's side bucket by bucket, so a
bfloat16 engine gets half the bytes of float32 master weights (slime and AReaL send bf16 for the same reason;
SGLang's /update_weights_from_distributed names a dtype per tensor for it). One broadcast serves the whole group,
so the group shares one wire dtype:

    wire = d            if every receiver declared the same floating dtype d and d is narrower than the source
    wire = source dtype otherwise (receivers that differ, or did not say, cast on load)

A receiver accepts any floating dtype and casts on load, as a real SGLang server does when it copies a received
tensor into its parameters; integer and bool tensors travel as they are and must match exactly. A name or shape
that does not fit the model is refused (`WeightMismatch`, naming the tensor) before anything is copied."""

from __future__ import annotations

from typing import Iterable

import torch

FLOATING = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class WeightMismatch(ValueError):
    """Received weights that do not fit the model (an unknown name, another shape, a non-floating dtype that
    differs): a resend cannot fix it, so a run that meets it fails."""


def floating_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a declared floating dtype name; None for no (or an unknown, e.g. SGLang's "auto")."""
    return _NAMES.get(name or "")


def wire_dtype(declared: Iterable[str | None], source: torch.dtype) -> torch.dtype:
    """The dtype floating tensors of a publish travel in (module docstring). `declared`: each receiver's
    served dtype name, None where a receiver did not say."""
    dtypes = [floating_dtype(d) for d in declared]
    if not dtypes or any(d is None for d in dtypes) or len(set(dtypes)) != 1:
        return source
    wanted = dtypes[0]
    assert wanted is not None  # none is None (checked above)
    return wanted if wanted.itemsize < source.itemsize else source


def check_fits(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Raise WeightMismatch naming the first received tensor that does not fit `params` (name -> tensor)."""
    for name, t in tensors.items():
        p = params.get(name)
        if p is None:
            raise WeightMismatch(f"received {name} {tuple(t.shape)} {t.dtype}: the model has no such parameter")
        if p.shape != t.shape:
            raise WeightMismatch(
                f"received {name} {tuple(t.shape)} {t.dtype} does not match the model's {tuple(p.shape)}"
            )
        if p.dtype != t.dtype and not (p.dtype in FLOATING and t.dtype in FLOATING):
            raise WeightMismatch(f"received {name} {tuple(t.shape)} {t.dtype} cannot be cast to the model's {p.dtype}")


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy received tensors into a model, each cast to its parameter's dtype (and device); every one is checked
    first (check_fits), so a mismatch changes nothing."""
    params = model_tensors(model)
    check_fits(params, tensors)
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)  # copy_ casts dtype and moves device
