"""The `megatron` trainer backend: megatron-core's GPTModel with tensor and pipeline parallelism, its
DistributedDataParallel, DistributedOptimizer and forward-backward schedules.

Ranks: the trainer's process group of W ranks is split by megatron into TP x PP x DP (DP = W / (TP x PP)); the
ranks of one TP x PP replica train the same rows, the replicas disjoint shares of each global batch.

The step (`train`): the share's micro batches, right-padded to one width and one row count (pipeline stages
exchange activations of a fixed shape), go through megatron's schedule; the last stage gathers the
vocabulary-parallel logits across TP and takes the same loss as every backend
(services/trainer/actor_update.py: micro_batch_loss). The schedule divides a micro batch's loss by the number
of micro batches and DDP averages gradients over DP, while ours is already normalised by the global batch's
totals, so the loss handed to it is multiplied by both:

    loss_to_schedule = micro_batch_loss * num_micro_batches * dp_size     (the gradient is then the global sum)

Gradient clipping (global norm over every shard, TP duplicates counted once) and AdamW are megatron's
DistributedOptimizer; weight decay applies to every parameter, as the torch backend's AdamW does.

On a machine without CUDA, services/trainer/megatron_cpu.py redirects megatron's CUDA calls first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

import torch
import torch.distributed as dist

from services.model.response_batch import ResponseBatch
from services.model.weight_files import write_weight_files
from services.run_contract.checkpoint import SHARDED, ShardedState
from services.trainer.actor_update import StepMetrics, global_totals, micro_batch_loss, micro_batches
from services.trainer.data_parallel import DataParallel
from services.trainer.megatron_cpu import install as install_cpu_shim
from services.trainer.megatron_model import build_gpt, init_model_parallel, to_megatron
from services.trainer.megatron_weights import ShardGather, ShardStream


class MegatronBackend:
    name = "megatron"
    gathers = True

    def __init__(
        self, hf_model, run, device: str, dp: DataParallel, tp: int = 1, pp: int = 1, sequence_parallel: bool = False
    ):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if dp.size % (tp * pp):
            raise ValueError(f"{dp.size} trainer ranks do not divide into TP={tp} x PP={pp}")
        dp.ensure_group()
        install_cpu_shim()
        init_model_parallel(tp, pp, run.optim.seed)
        self.dp, self.tp, self.pp = dp, tp, pp
        self.sequence_parallel = sequence_parallel and tp > 1  # megatron's: only with tensor parallelism
        self.stage, self.tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        self.data_rank, self.data_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.hf_config = hf_model.config
        hf_state = hf_model.state_dict()
        model = build_gpt(
            self.hf_config,
            tp,
            pp,
            pre_process=self.first,
            post_process=self.last,
            sequence_parallel=self.sequence_parallel,
        )
        missing, unexpected = model.load_state_dict(
            to_megatron(hf_state, self.hf_config, tp, self.tp_rank, pp, self.stage), strict=False
        )
        if unexpected or any(not k.endswith("_extra_state") for k in missing):
            raise RuntimeError(f"HF -> megatron left tensors unmatched: missing {missing}, unexpected {unexpected}")
        model.config.finalize_model_grads_func = finalize_model_grads  # DP (and embedding) gradient reduction
        self.model = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
        )
        o = run.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.betas[0],
                adam_beta2=o.betas[1],
                adam_eps=1e-8,
                clip_grad=o.grad_clip,
                bf16=False,
                fp16=False,
                use_distributed_optimizer=True,
            ),
            [self.model],
            config_overrides={},
        )  # {}: weight decay on every parameter, as torch's AdamW
        self.weights = ShardGather(self.model, self.hf_config, hf_state, dp, tp, pp)

    # ------------------------------------------------------------------ one step

    def train(
        self, batch, run, micro_batch_size: int, device: str = "cpu", totals: tuple[float, float] | None = None
    ) -> StepMetrics:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        totals = global_totals(batch, totals)
        micro = uniform(
            list(micro_batches(batch, micro_batch_size, device)),
            micro_batch_size,
            self.tp if self.sequence_parallel else 1,
        )
        scale = len(micro) * self.data_size
        width = micro[0][1].input_ids.shape[1]
        positions = torch.arange(width)[None].expand(micro_batch_size, -1)

        def forward_step(data, model):
            sl, rb, mask, rows = next(data)
            out = model(input_ids=rb.input_ids, position_ids=positions, attention_mask=None)

            def loss_func(output):
                real = _response_rows(rb, rows)
                logits = real.gather_response(gather_from_tensor_model_parallel_region(output)[:rows])
                if run.rollout.temperature != 1.0:
                    logits = logits / run.rollout.temperature
                loss, m, tokens = micro_batch_loss(logits, real, mask, batch, sl, run, totals, device)
                return loss * scale, {"loss": loss.detach(), "tokens": tokens, **m}

            return out, loss_func

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=width,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = self.optimizer.step()
        return self._metrics(outputs, float(grad_norm if grad_norm is not None else math.nan))

    def _metrics(self, outputs: list[dict], grad_norm: float) -> StepMetrics:
        """The step's metrics as one process over the global batch would report them, on every rank: the last
        stage's TP rank 0 of each replica contributes its micro batches; summed (ratio_max: max) over the world,
        with the metrics this loss configuration reports."""
        local = StepMetrics()
        for m in outputs if (self.last and self.tp_rank == 0) else []:
            local.add({k: v for k, v in m.items() if k not in ("loss", "tokens")}, float(m["tokens"]))
            local.loss += float(m["loss"])
        present = torch.tensor([float(n in local.sums) for n in METRIC_NAMES])
        sums = torch.tensor(
            [local.sums.get(n, 0.0) for n in METRIC_NAMES] + [local.loss, local.tokens], dtype=torch.float64
        )
        ratio_max = torch.tensor([local.sums.get("ratio_max", 0.0)], dtype=torch.float64)
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        total = StepMetrics(loss=float(sums[-2]), tokens=float(sums[-1]), grad_norm=grad_norm)
        for i, name in enumerate(METRIC_NAMES):
            if present[i]:
                total.sums[name] = float(ratio_max) if name == "ratio_max" else float(sums[i])
        return total

    # ------------------------------------------------------------------ weights

    def weight_stream(self) -> ShardStream:
        return ShardStream(self.weights)

    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _shard_file(self, directory: str, index: int) -> str:
        return os.path.join(directory, f"optimizer_tp{self.tp_rank:02d}_pp{self.stage:02d}_{index}.pt")

    def _init_adam_state(self) -> None:
        """The state torch's AdamW keeps per parameter, zeroed, where it has none yet: loading writes into the
        state tensors that exist, and neither megatron's init_state_fn nor a fresh torch AdamW has them all
        (`step`) before the first update."""
        for chained in self._optimizers():
            inner = chained.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p] = {
                            "step": torch.tensor(0.0),
                            "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p),
                        }

    def write_checkpoint_files(self, scratch_dir: str) -> ShardedState | None:
        """The DistributedOptimizer's state in megatron's own distributed-optimizer format under `sharded/`, one
        file per (TP, PP) rank written by its data-parallel rank 0 (the state gathered over DP: tensors and plain
        values only), and the HF export of the weights, streamed unit by unit to the leader, which writes a file
        at a time (a resume builds the model from it)."""
        if self.dp.is_leader:  # a crash's leftover
            shutil.rmtree(scratch_dir, ignore_errors=True)
        self.dp.barrier()
        sharded = os.path.join(scratch_dir, SHARDED)
        os.makedirs(sharded, exist_ok=True)
        for index, optimizer in enumerate(self._optimizers()):
            state = {"common": optimizer.state_dict(), "params": optimizer.get_parameter_state_dp_zero()}
            if self.data_rank == 0:
                torch.save(state, self._shard_file(sharded, index))
        self.dp.barrier()
        model_dir = os.path.join(scratch_dir, "model")
        write_weight_files(self.weight_stream(), model_dir)
        return ShardedState(model_dir, sharded) if self.dp.is_leader else None

    def load_optimizer(self, checkpoint_path: str) -> None:
        """The optimizer state of a megatron checkpoint of the same TP x PP layout (any data-parallel size: DP
        rank 0 scatters it). The model was built from the checkpoint's HF export."""
        sharded = os.path.join(checkpoint_path, SHARDED)
        if not os.path.isdir(sharded):
            raise RuntimeError(
                f"{checkpoint_path} has no megatron checkpoint ({SHARDED}/): written by another "
                "backend, it holds the weights but not megatron's optimizer state"
            )
        self._init_adam_state()
        for index, optimizer in enumerate(self._optimizers()):
            path = self._shard_file(sharded, index)
            if not os.path.isfile(path):
                raise RuntimeError(f"{path} is missing: the checkpoint was written with another TP x PP layout")
            saved = torch.load(path, weights_only=True)  # our own file: tensors and plain values
            optimizer.load_state_dict(saved["common"])
            with torch.no_grad():  # it copies into the (leaf) main parameters
                optimizer.load_parameter_state_from_dp_zero(saved["params"] if self.data_rank == 0 else None)
            # megatron puts one `step` tensor into every parameter's state; torch's AdamW advances each
            # parameter's own in place, so a shared one would count a step once per parameter
            for state in optimizer.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()


# every metric micro_batch_loss reports (policy_loss's and the rollout distance), summed token-weighted
METRIC_NAMES = (
    "pg_loss",
    "clip_fraction",
    "dual_clip_fraction",
    "approx_kl",
    "ratio_max",
    "kl",
    "entropy",
    "tis_weight_mean",
    "rollout_logprob_abs_diff",
    "rollout_kl_k3",
)


def _response_rows(rb: ResponseBatch, rows: int) -> ResponseBatch:
    if rows == rb.input_ids.shape[0]:
        return rb
    return dataclasses.replace(rb, **{f.name: getattr(rb, f.name)[:rows] for f in dataclasses.fields(rb)})


def uniform(micro: list, rows: int, multiple: int = 1) -> list:
    """(slice, ResponseBatch, mask, real rows) per micro batch, every ResponseBatch padded to the widest (rounded
    up to a `multiple`: sequence parallelism splits the sequence over the TP ranks) and to `rows` rows (copies
    of its first row; their loss is cut off by `real rows`): pipeline stages exchange activations of one
    shape. Padding goes on the right, which a causal model's earlier positions never see."""
    width = -(-max(rb.input_ids.shape[1] for _, rb, _ in micro) // multiple) * multiple
    out = []
    for sl, rb, mask in micro:
        n, w = rb.input_ids.shape
        ids = torch.zeros(rows, width, dtype=rb.input_ids.dtype)
        ids[:n, :w] = rb.input_ids
        ids[n:, :w] = rb.input_ids[:1]
        out.append((sl, dataclasses.replace(rb, input_ids=ids), mask, n))
    return out
