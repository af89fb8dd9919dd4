"""The actor's LoRA adapter (run config `trainer.lora`), through peft.

With LoRA on, the actor model is peft's `PeftModel` around the run's base model: each targeted linear layer
keeps its weight W0 frozen and trains A [r, in] and B [out, r] (Hu et al., 2021),

    W = W0 + (alpha / r) * B @ A            (B starts at zero, so step 0's model is the base model)

so only A and B have gradients and AdamW moments, and only they are published and checkpointed. Their names
on the wire and in a checkpoint are peft's saved form (`base_model.model.<module>.lora_A.weight`,
`get_peft_model_state_dict`), which the built-in engine merges (services/engine/adapter_merge.py) and
`PeftModel.from_pretrained` reads. peft is imported only when a run asks for LoRA."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from services.model.loading import load_causal_lm
from services.run_contract.trainer_settings import LoraSettings

ADAPTER = "default"  # peft's name of a model's single adapter; dropped from the saved names
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's checkpoint files


def lora_config(settings: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        task_type="CAUSAL_LM",
    )


def with_adapter(base: torch.nn.Module, settings: LoraSettings, checkpoint: str | None = None) -> torch.nn.Module:
    """`base` with a fresh adapter (peft's init: A Kaiming-uniform, B zero; the caller seeds torch), or the one
    saved in `checkpoint` (peft's files, written by save_pretrained). Only the adapter requires gradients."""
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    model = get_peft_model(base, lora_config(settings))
    if checkpoint is not None:
        path = os.path.join(checkpoint, ADAPTER_FILE)
        if not os.path.isfile(path):
            raise RuntimeError(
                f"{checkpoint} holds no LoRA adapter ({ADAPTER_FILE}): it was written by a run "
                "that trained every weight; resume it without trainer.lora"
            )
        result = set_peft_model_state_dict(model, load_file(path))
        if result.unexpected_keys:
            raise RuntimeError(
                f"{path} does not fit trainer.lora (rank {settings.rank}, target_modules "
                f"{settings.target_modules}): it has {sorted(result.unexpected_keys)[:3]}"
            )
    return model


def load_actor(run, checkpoint: str | None, dtype, device: str):
    """The model the actor trains: the checkpoint's full weights (or the base model's), or, with LoRA
    (`run.trainer.lora`), the run's base model with the checkpoint's adapter (a fresh one without a checkpoint)."""
    settings = run.trainer.lora
    if settings is None:
        return load_causal_lm(checkpoint or run.model, dtype, device)[0]
    base, _ = load_causal_lm(run.model, dtype, device)
    return with_adapter(base, settings, checkpoint).to(device)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def peft_model(model: torch.nn.Module) -> Any | None:
    """`model` as peft's PeftModel, None when it carries no adapter. Typed Any, as mypy reads peft: through
    torch's Module, a PeftModel's own attributes (peft_config, get_base_model) would read as Tensor | Module."""
    return model if is_lora(model) else None


def adapter_settings(model: torch.nn.Module) -> Any:
    """peft's LoraConfig of a PeftModel's adapter; ValueError for a model without one."""
    peft = peft_model(model)
    if peft is None:
        raise ValueError(f"{type(model).__name__} carries no LoRA adapter")
    return peft.peft_config[ADAPTER]


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model itself (with the adapter's layers in it, for a PeftModel)."""
    peft = peft_model(model)
    return model if peft is None else peft.get_base_model()


def saved_name(name: str) -> str:
    """peft's saved form of a trainable parameter's name: the adapter's own name dropped
    (`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`)."""
    return name.replace(f".{ADAPTER}.", ".")


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer holds: every one, or with LoRA only the adapter's."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def published(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a publish sends: every parameter under its Hugging Face name, or with LoRA only the adapter's
    tensors under peft's saved names."""
    if not is_lora(model):
        return [(n, p.detach()) for n, p in model.named_parameters()]
    return [(saved_name(n), p.detach()) for n, p in trainable(model)]


def adapter_scaling(model: torch.nn.Module) -> float | None:
    """alpha / r of the model's adapter; None without LoRA."""
    if not is_lora(model):
        return None
    config = adapter_settings(model)
    return config.lora_alpha / config.r


def adapter_config(model: torch.nn.Module) -> dict | None:
    """peft's adapter_config.json of the model's adapter, as save_pretrained writes it (sets as lists, enums as
    their values); None without LoRA."""
    if not is_lora(model):
        return None
    return json.loads(
        json.dumps(adapter_settings(model).to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    )


def write_adapter(stream, model: torch.nn.Module, directory: str) -> None:
    """peft's checkpoint files (adapter_model.safetensors, adapter_config.json, which names the base model) of
    the adapter `stream` yields: a sharded backend's gathered adapter, written by the rank that keeps it."""
    from safetensors.torch import save_file

    try:
        tensors = dict(stream.take(len(stream.specs())))
    finally:
        stream.close()
    if tensors:
        os.makedirs(directory, exist_ok=True)
        save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(directory, ADAPTER_FILE))
        adapter_settings(model).save_pretrained(directory)
