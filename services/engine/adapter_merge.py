"""A LoRA adapter received as a weight update (a run with trainer.lora publishes only its adapter), merged into
the engine's base weights:

    W = W0 + s * B @ A          A [r, in], B [out, r], s = alpha / r   (Hu et al., 2021, "LoRA")

W0 is the weight the engine had before the first adapter reached it, kept aside: every update computes W from
W0 again, never by subtracting the previous adapter, so a new version replaces the old one exactly (no drift
from rounding, nothing accumulates) and a layer the new adapter leaves out gets W0 back. The cost is a copy of
each targeted weight. A full update of a weight (another publish of every weight) makes it the new W0.

Tensors arrive under peft's saved names: `base_model.model.<module>.lora_A.weight` and `.lora_B.weight`, where
`<module>.weight` is the targeted linear layer's weight. The scale s comes with the update (`lora_scaling`, a
Sluice extension of SGLang's update requests: services/engine/protocol.py)."""

from __future__ import annotations

import torch

from services.dcs.sync.precision import WeightMismatch

PREFIX = "base_model.model."
PARTS = {".lora_A.weight": "A", ".lora_B.weight": "B"}


def adapter_part(name: str) -> tuple[str, str] | None:
    """(the targeted weight's name, "A" or "B") of an adapter tensor's name; None for any other name."""
    if not name.startswith(PREFIX):
        return None
    for suffix, part in PARTS.items():
        if name.endswith(suffix):
            return name[len(PREFIX) : -len(suffix)] + ".weight", part
    return None


def _split(name: str) -> tuple[str, str]:
    """adapter_part of a name the caller took as an adapter tensor's; WeightMismatch for any other name."""
    found = adapter_part(name)
    if found is None:
        raise WeightMismatch(
            f"{name} is not an adapter tensor's name ({PREFIX}<module>.lora_A.weight or .lora_B.weight)"
        )
    return found


def check_adapter(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Raise WeightMismatch naming the first adapter tensor that cannot target `params`: no such linear layer,
    or A [r, in] / B [out, r] that do not fit its weight [out, in]."""
    for name, t in tensors.items():
        weight, part = _split(name)
        w = params.get(weight)
        if w is None or w.dim() != 2:
            raise WeightMismatch(f"received adapter tensor {name}: the model has no linear layer weight {weight}")
        side = 1 if part == "A" else 0  # A's columns are the layer's inputs, B's rows its outputs
        if t.dim() != 2 or t.shape[side] != w.shape[side] or not t.is_floating_point():
            raise WeightMismatch(
                f"received adapter tensor {name} {tuple(t.shape)} {t.dtype} does not fit {weight} {tuple(w.shape)}"
            )


def adapter_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """weight name -> (A, B) of a whole adapter; WeightMismatch when a layer's A or B is missing or their ranks
    differ."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        weight, part = _split(name)
        parts.setdefault(weight, {})[part] = t
    pairs = {}
    for weight, got in parts.items():
        if set(got) != {"A", "B"} or got["A"].shape[0] != got["B"].shape[1]:
            raise WeightMismatch(
                f"the adapter of {weight} came incomplete or with two ranks: "
                f"{ {k: tuple(v.shape) for k, v in got.items()} }"
            )
        pairs[weight] = (got["A"], got["B"])
    return pairs


class MergedAdapter:
    """The base weights W0 of every layer an adapter was merged into, and the merge (module docstring)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        self.base: dict[str, torch.Tensor] = {}  # weight name -> W0

    def apply(self, tensors: dict[str, torch.Tensor], scaling: float) -> None:
        """Every targeted weight becomes W0 + scaling * B @ A; the others that had an adapter get W0 back. The
        adapter is checked whole first (adapter_pairs), so a bad one changes nothing."""
        pairs = adapter_pairs(tensors)
        with torch.no_grad():
            for weight in [w for w in self.base if w not in pairs]:
                self.params[weight].copy_(self.base.pop(weight))
            for weight, (a, b) in pairs.items():
                w = self.params[weight]
                w0 = self.base.setdefault(weight, w.detach().clone())
                delta = (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)) * scaling
                w.copy_(w0.float() + delta)  # copy_ casts to the weight's dtype

    def rebase(self, names) -> None:
        """Weights loaded in full are their own W0 from now on."""
        for name in names:
            self.base.pop(name, None)
