"""The actor's training backends behind one interface: what the trainer role asks of the model it trains.

`torch`: every data-parallel rank holds the whole model, optimizer state and gradients; the ranks' gradients are
summed in one all-reduce (services/trainer/data_parallel.py). `fsdp`: torch's FSDP2 shards parameters, gradients
and optimizer state over the ranks (services/trainer/fsdp_backend.py). `megatron`: megatron-core with tensor and
pipeline parallelism (services/trainer/megatron_backend.py). The role's loop, the loss (services/algorithms) and
the weight publishing path are the same for all: the loop calls `train`, publishes what `weight_stream`
yields and checkpoints what `write_checkpoint_files` wrote (a sharded backend) or the live model and optimizer
(torch), in the checkpoint layout of services/run_contract/checkpoint.py (torch and fsdp checkpoints resume
under either).
"""

from __future__ import annotations

from typing import Callable, Protocol

import os

import torch

from services.dcs.sync.layout import WeightStream
from services.model.response_batch import ResponseLogits
from services.run_contract.checkpoint import SHARDED, ShardedState, load_optimizer_state
from services.trainer.actor_update import StepMetrics, actor_step
from services.trainer.data_parallel import DataParallel
from services.trainer.lora import published, trainable
from services.trainer.optimizer import adamw
from services.trainer.precision import check_precision, fsdp_compute_dtype

BACKENDS = ("torch", "fsdp", "megatron")


class TrainerBackend(Protocol):
    name: str
    optimizer: torch.optim.Optimizer  # its param_groups carry the learning rate (set per step)
    gathers: bool  # the full weights exist only by a collective of every rank
    data_rank: int  # which share of each global batch this rank trains ...
    data_size: int  # ... of how many (ranks of one model replica train the same rows)

    def train(
        self, batch, run, micro_batch_size: int, device: str = "cpu", totals: tuple[float, float] | None = None
    ) -> StepMetrics:
        """One optimizer step on this rank's share `batch` of a global batch whose (tokens, sequences) are
        `totals`. Metrics: torch and fsdp report this rank's share's, megatron the global batch's."""

    def weight_stream(self) -> WeightStream | None:
        """Collective when `gathers`: the full weights with Hugging Face names (with LoRA: the adapter's, in
        peft's names) as a stream every rank makes and consumes in the same order (the leader's publisher takes
        it, the other ranks close it at once); None from a backend that does not gather: it publishes
        `live_weights()`."""

    def write_checkpoint_files(self, scratch_dir: str) -> ShardedState | None:
        """Collective when `gathers`: a checkpoint's files written under `scratch_dir` by the ranks together (the
        weights as HF files, streamed; the optimizer state sharded), and on the leader what was written; None
        elsewhere, and from a backend whose checkpoint is its live model and optimizer (torch)."""

    def load_optimizer(self, checkpoint_path: str) -> None: ...


class TorchBackend:
    """Plain torch: the whole model on every rank; gradients summed by DataParallel."""

    name = "torch"
    gathers = False

    def __init__(self, hf_model, run, device: str, dp: DataParallel, precision: str = "fp32"):
        self.dp = dp
        self.precision = precision  # bf16 weights are loaded so (service.py); bf16-mixed autocasts the forward
        self.data_rank, self.data_size = dp.rank, dp.size
        self.policy = ResponseLogits(hf_model)  # with LoRA a PeftModel: only the adapter is optimized
        self.optimizer: torch.optim.Optimizer = adamw(
            [p for _, p in trainable(hf_model)], run.optim.lr, run.optim.betas, run.optim.weight_decay, device
        )

    def train(self, batch, run, micro_batch_size: int, device: str = "cpu", totals=None) -> StepMetrics:
        return actor_step(
            self.policy,
            self.optimizer,
            batch,
            run,
            micro_batch_size,
            device,
            totals,
            reduce_gradients=self.dp.sum_gradients,
            precision=self.precision,
        )

    def weight_stream(self):
        return None

    def live_weights(self) -> list:
        """What a publish sends: every parameter, or with LoRA the adapter's tensors (services/trainer/lora.py)."""
        return published(self.policy.hf)

    def write_checkpoint_files(self, scratch_dir: str) -> None:
        return None  # the leader saves its model and optimizer as they are

    def load_optimizer(self, checkpoint_path: str) -> None:
        """The torch-format optimizer.pt, or an fsdp checkpoint's DCP optimizer state read whole."""
        sharded = os.path.join(checkpoint_path, SHARDED)
        if os.path.isfile(os.path.join(checkpoint_path, "optimizer.pt")) or not os.path.isdir(sharded):
            load_optimizer_state(checkpoint_path, self.optimizer)
            return
        from services.trainer.fsdp_backend import is_dcp, torch_format_optimizer  # torch.distributed.fsdp only here

        if not is_dcp(sharded):
            raise RuntimeError(
                f"{checkpoint_path} holds megatron's optimizer state, which the torch backend does not "
                "read: resume it with --backend megatron and the same TP x PP"
            )
        names = [n for n, _ in trainable(self.policy.hf)]
        self.optimizer.load_state_dict(torch_format_optimizer(sharded, names))


def live_weights_of(backend: TrainerBackend) -> Callable[[], list]:
    """What a backend that does not gather publishes (TrainerBackend.weight_stream): its live weights."""
    if not isinstance(backend, TorchBackend):
        raise TypeError(f"the {backend.name} backend gathers its weights: it publishes their stream")
    return backend.live_weights


def make_backend(
    name: str,
    hf_model,
    run,
    device: str,
    dp: DataParallel,
    param_dtype: str = "",
    cpu_offload: bool = False,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "fp32",
) -> TrainerBackend:
    """The backend `name` training `hf_model` (loaded in `precision`'s weights dtype: precision.py)."""
    check_precision(name, precision, param_dtype)  # for callers that skip TrainerConfig's own check
    if run.trainer.lora is not None and name not in ("torch", "fsdp"):
        raise ValueError(
            f"trainer.lora trains with the torch or fsdp backend, not {name}: start the trainer with "
            "--backend torch or --backend fsdp, or train every weight"
        )
    if name == "torch":
        return TorchBackend(hf_model, run, device, dp, precision)
    if name == "fsdp":
        from services.trainer.fsdp_backend import FSDPBackend  # torch.distributed.fsdp only when asked for

        return FSDPBackend(
            hf_model, run, device, dp, param_dtype=fsdp_compute_dtype(precision, param_dtype), cpu_offload=cpu_offload
        )
    if name == "megatron":
        from services.trainer.megatron_backend import MegatronBackend  # megatron-core only when asked for

        return MegatronBackend(hf_model, run, device, dp, tp=tp, pp=pp, sequence_parallel=sequence_parallel)
    raise ValueError(f"unknown trainer backend {name!r} ({', '.join(BACKENDS)})")
