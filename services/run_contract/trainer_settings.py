"""The run's `trainer:` section: what the actor trains, which every role that meets its weights must agree on
(the engines receive an adapter instead of full weights when `lora` is set)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# the projections of a Llama/Qwen2 decoder layer: every linear layer but the vocabulary projection
ModuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.]{1,128}$")]
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(BaseModel):
    """LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): each targeted linear layer
    W0 [out, in] is frozen and trained as W = W0 + (alpha / rank) * B @ A, A [rank, in], B [out, rank] (B starts
    at zero), through peft (docs/trainer.md, "LoRA")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rank: int = Field(8, ge=1, le=4096, description="r: the rank of each adapter's A [r, in] and B [out, r]")
    alpha: float = Field(16.0, gt=0, le=1e6, description="the adapter's update is scaled by alpha / rank")
    target_modules: list[ModuleName] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        min_length=1,
        max_length=64,
        description="names of the linear layers that get an adapter (a module whose name ends in one of these)",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class TrainerSettings(BaseModel):
    """What the actor trains (the trainer service's own flags are its operational settings)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lora: LoraSettings | None = Field(
        None,
        description=(
            "train a LoRA adapter instead of every weight: only the adapter is trained, held in the optimizer, "
            "published (the built-in engine merges it into its base weights; SGLang engines load it by name through "
            "their LoRA routes) and checkpointed (peft's format); torch and fsdp backends; null = full fine-tuning"
        ),
    )
