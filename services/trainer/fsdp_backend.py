"""The `fsdp` trainer backend: torch's FSDP2 (`fully_shard`) over the data-parallel ranks.

Each decoder layer is its own FSDP unit and the rest (embeddings, final norm, vocabulary projection) is the
root's, so a rank holds 1/ranks of every parameter, gradient and AdamW moment, and gathers one layer's
parameters at a time in forward and backward. The ranks train disjoint shares of each global batch, as the
torch backend's do.

Gradients: the loss of each rank is already normalised by the *global* batch's totals (tokens, sequences;
services/algorithms/policy_loss.py), so the global gradient is the sum over ranks. FSDP's reduce-scatter
averages; `reduce_gradients` multiplies by the number of ranks (gloo has no PREMUL_SUM, which
`set_gradient_divide_factor(1.0)` needs).

Publishing and checkpoints are collectives every rank joins from its main loop, and no rank ever holds the
whole model: `weight_stream` gathers one parameter at a time as the weight publisher on the leader packs its
buckets (the publish does not overlap the next step). A checkpoint (`write_checkpoint_files`) is the same
stream written as Hugging Face safetensors files a file at a time (services/model/weight_files.py) and the
optimizer state saved sharded with torch.distributed.checkpoint (DCP), each rank its own share, under
`sharded/`. A resume reads a DCP optimizer state into the shards (any number of ranks: DCP reshards), or the
torch backend's `optimizer.pt`; the torch backend reads fsdp's DCP state too (`torch_format_optimizer`), so
checkpoints move between the two. On CPU/gloo mixed precision and offload are options, not defaults.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    OptimizerStateType,
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from services.model.response_batch import ResponseLogits
from services.model.weight_files import write_weight_files
from services.run_contract.checkpoint import SHARDED, ShardedState
from services.trainer.actor_update import StepMetrics, actor_step
from services.trainer.data_parallel import DataParallel
from services.trainer.lora import base_of, is_lora, saved_name, trainable, write_adapter
from services.trainer.optimizer import adamw
from services.trainer.weight_stream import GatheredParameters

PREFIX = "hf."  # ResponseLogits names its model's parameters hf.<HF name>


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


class FSDPBackend:
    name = "fsdp"
    gathers = True

    def __init__(self, hf_model, run, device: str, dp: DataParallel, param_dtype: str = "", cpu_offload: bool = False):
        dp.ensure_group()
        self.dp = dp
        self.data_rank, self.data_size = dp.rank, dp.size
        self.device = device
        kind = torch.device(device).type
        mesh = init_device_mesh(kind, (dp.size,))
        # param_dtype: compute in it, reduce gradients in float32; else FSDP's defaults (no casts, no offload)
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
            if param_dtype
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
        self.policy = ResponseLogits(hf_model)  # with LoRA a PeftModel: frozen base, trained adapter
        layers = base_of(hf_model).get_submodule("model.layers")
        if not isinstance(layers, torch.nn.ModuleList):
            raise TypeError(
                f"fsdp shards a decoder's layers (model.layers, a ModuleList); this model's are a "
                f"{type(layers).__name__}"
            )
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
        fully_shard(self.policy, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
        self.names = [n for n, _ in trainable(hf_model)]  # the optimizer's parameters, in its order
        self.optimizer: torch.optim.Optimizer = adamw(
            [p for _, p in trainable(self.policy)],
            run.optim.lr,
            run.optim.betas,
            run.optim.weight_decay,
            "cpu" if cpu_offload else device,
        )

    def train(self, batch, run, micro_batch_size: int, device: str = "cpu", totals=None) -> StepMetrics:
        # gradients are reduce-scattered after the last micro batch only: the others accumulate locally
        return actor_step(
            self.policy,
            self.optimizer,
            batch,
            run,
            micro_batch_size,
            device,
            totals,
            reduce_gradients=self.reduce_gradients,
            last_micro_batch=self.policy.set_requires_gradient_sync,
        )

    def reduce_gradients(self, params) -> None:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(self.dp.size)

    def weight_stream(self) -> GatheredParameters:
        """Every parameter's full tensor (with LoRA: the adapter's, under peft's saved names), gathered one at a
        time as the publisher takes them (collective)."""
        hf = self.policy.hf
        named = [(saved_name(n), p) for n, p in trainable(hf)] if is_lora(hf) else hf.named_parameters()
        return GatheredParameters(named, _full, keep=self.dp.is_leader)

    def write_checkpoint_files(self, scratch_dir: str) -> ShardedState | None:
        """Collective: the weights as HF files (streamed, written by the leader) and each rank's share of the
        optimizer state (DCP) under `scratch_dir`; what was written, on the leader."""
        if self.dp.is_leader:  # a crash's leftover
            shutil.rmtree(scratch_dir, ignore_errors=True)
        self.dp.barrier()
        model_dir, sharded = os.path.join(scratch_dir, "model"), os.path.join(scratch_dir, SHARDED)
        if is_lora(self.policy.hf):  # the adapter in peft's files
            write_adapter(self.weight_stream(), self.policy.hf, model_dir)
        else:
            write_weight_files(self.weight_stream(), model_dir)
        dcp.save({"optimizer": get_optimizer_state_dict(self.policy, self.optimizer)}, checkpoint_id=sharded)
        return ShardedState(model_dir, sharded) if self.dp.is_leader else None

    def load_optimizer(self, checkpoint_path: str) -> None:
        """Each rank reads its share of the optimizer state: from fsdp's DCP state (written with any number of
        ranks), or from the torch backend's optimizer.pt (every rank reads it whole and keeps its shard)."""
        sharded = os.path.join(checkpoint_path, SHARDED)
        if is_dcp(sharded):
            state = {"optimizer": get_optimizer_state_dict(self.policy, self.optimizer)}
            dcp.load(state, checkpoint_id=sharded)
            set_optimizer_state_dict(self.policy, self.optimizer, state["optimizer"])
            return
        if not os.path.isfile(os.path.join(checkpoint_path, "optimizer.pt")):
            raise RuntimeError(
                f"{checkpoint_path} has neither fsdp's optimizer state ({SHARDED}/ in DCP format) nor "
                "the torch backend's (optimizer.pt): written by another backend, it holds the "
                "weights but not an optimizer state fsdp reads"
            )
        saved = torch.load(os.path.join(checkpoint_path, "optimizer.pt"), weights_only=True)
        fqn = [PREFIX + n for n in self.names]
        whole: OptimizerStateType = {
            "state": {fqn[int(i)]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [fqn[int(i)] for i in g["params"]]} for g in saved["param_groups"]],
        }
        set_optimizer_state_dict(self.policy, self.optimizer, whole, options=StateDictOptions(full_state_dict=True))


def is_dcp(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, ".metadata"))


def torch_format_optimizer(sharded: str, names: list[str]) -> dict:
    """fsdp's DCP optimizer state as torch's optimizer.state_dict() (state keyed by the index of the parameter
    in Hugging Face order, `names`), read whole in this process: what the torch backend loads."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "optimizer.pt")
        dcp_to_torch_save(sharded, path)
        optim = torch.load(path, weights_only=True)["optimizer"]
    index = {PREFIX + n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[f] for f in g["params"]]} for g in optim["param_groups"]]
    return {"state": {index[f]: s for f, s in optim["state"].items()}, "param_groups": groups}
