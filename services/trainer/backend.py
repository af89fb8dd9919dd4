"""The actor's training backends behind one interface: what the trainer role asks of the model it trains.

`torch`: every data-parallel rank holds the whole model, optimizer state and gradients; the ranks' gradients are
summed in one all-reduce (services/trainer/data_parallel.py). `fsdp`: torch's FSDP2 shards parameters, gradients
and optimizer state over the ranks (services/trainer/fsdp_backend.py). The role's loop, the loss
(services/algorithms) and the weight publishing path are the same for both: the loop trains `policy` with
actor_step, publishes what `gather_weights` returns and checkpoints what `full_state` returns, in the one
checkpoint format of services/run_contract/checkpoint.py (so a run can resume under another backend).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from services.model.response_batch import ResponseLogits
from services.run_contract.checkpoint import load_optimizer_state
from services.trainer.data_parallel import DataParallel
from services.trainer.optimizer import adamw

BACKENDS = ("torch", "fsdp")


class TrainerBackend(Protocol):
    name: str
    policy: ResponseLogits             # what actor_step trains; its `hf` is the Hugging Face model
    optimizer: torch.optim.Optimizer
    gathers: bool                      # the full weights exist only by a collective of every rank

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """After the step's backward passes, before clipping: make the gradients those of the global batch."""

    def gather_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """Collective when `gathers`: a copy of the full weights with Hugging Face names on the leader (None on
        the other ranks, and from a backend that does not gather: it publishes its live weights)."""

    def full_state(self) -> tuple[dict, dict] | None:
        """Collective when `gathers`: (model state dict, optimizer state dict in torch's own format) on the
        leader, for a checkpoint; None elsewhere."""

    def load_optimizer(self, checkpoint_path: str) -> None: ...


class TorchBackend:
    """Plain torch: the whole model on every rank; gradients summed by DataParallel."""

    name = "torch"
    gathers = False

    def __init__(self, hf_model, run, device: str, dp: DataParallel):
        self.dp = dp
        self.policy = ResponseLogits(hf_model)
        self.optimizer = adamw(hf_model.parameters(), run.optim.lr, run.optim.betas, run.optim.weight_decay,
                               device)

    def reduce_gradients(self, params) -> None:
        self.dp.sum_gradients(params)

    def gather_weights(self):
        return None

    def full_state(self):
        return (self.policy.hf.state_dict(), self.optimizer.state_dict()) if self.dp.is_leader else None

    def load_optimizer(self, checkpoint_path: str) -> None:
        load_optimizer_state(checkpoint_path, self.optimizer)


def make_backend(name: str, hf_model, run, device: str, dp: DataParallel, **fsdp_options) -> TrainerBackend:
    if name == "torch":
        return TorchBackend(hf_model, run, device, dp)
    if name == "fsdp":
        from services.trainer.fsdp_backend import FSDPBackend  # torch.distributed.fsdp only when asked for
        return FSDPBackend(hf_model, run, device, dp, **fsdp_options)
    raise ValueError(f"unknown trainer backend {name!r} ({', '.join(BACKENDS)})")
