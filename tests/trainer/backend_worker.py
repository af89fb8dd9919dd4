"""The actor ranks of test_trainer_backends, a pool of them (tests/trainer/rank_pool.py) running its plan's
cases: each case is one optimizer step (AdamW, gradient clipping) of one trainer backend in one layout on its
share of a fixed global batch, then (leader) the step's loss and gradient norm, a checkpoint of the gathered
state and the updated weights. A case that resumes reads the model and optimizer state from an earlier case's
checkpoint first."""

import json
import os
import pathlib

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import latest_checkpoint, save_checkpoint
from services.run_contract.run_config import RunConfig
from services.trainer.actor_update import actor_step
from services.trainer.backend import make_backend
from services.trainer.data_parallel import DataParallel
from services.trainer.lora import load_actor
from services.transferqueue.codec import Batch
from tests.trainer.rank_pool import WAIT_S, serve
from tests.trainer.test_actor_update import _batch

RUN = dict(
    name="r",
    n_samples_per_prompt=2,
    rollout_batch_size=2,
    global_batch_size=4,
    micro_batch_size=1,
    optim={"lr": 1e-3, "grad_clip": 0.5},
)  # Adam moves every weight by ~lr
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "o_proj", "up_proj"]}


def train_once(
    backend: str,
    model_dir: str,
    dp: DataParallel,
    out_dir: str,
    resume: str = "",
    seed: int = 0,
    tp: int = 1,
    pp: int = 1,
    sp: bool = False,
    lora: bool = False,
):
    run = RunConfig(model=model_dir, **RUN, trainer={"lora": LORA if lora else None})
    torch.manual_seed(0)  # a fresh adapter's initial A
    model = load_actor(run, resume or None, "float32", "cpu")
    b = make_backend(backend, model, run, "cpu", dp, tp=tp, pp=pp, sequence_parallel=sp)
    if resume:
        b.load_optimizer(resume)
    full = _batch(seed)
    mine = dp.my_rows(full.rows, full["response_length"].tolist(), 2, b.data_rank, b.data_size)
    share = Batch(
        partition="train_0",
        rows=mine,
        columns={k: ([v[i] for i in mine] if isinstance(v, list) else v[mine]) for k, v in full.columns.items()},
    )
    tokens = dp.total(float(sum(float(m.sum()) for m in share["loss_mask"]))) / (dp.size // b.data_size)
    m = b.train(share, run, 1, totals=(tokens, 4.0))
    loss = m.loss if backend == "megatron" else dp.total(m.loss)  # megatron's metrics are the global batch's
    stream = b.weight_stream()
    weights = _taken(stream) if stream is not None else b.live_weights()
    state = b.write_checkpoint_files(os.path.join(out_dir, "actor", "step_00000001.sharded.tmp"))
    if dp.is_leader:
        save_checkpoint(out_dir, "actor", model, b.optimizer, model_dir, 1, 1, state=state)
        _write(out_dir, weights, loss, m.grad_norm)


def _taken(stream) -> list:
    """Everything the stream yields, taken three tensors at a time as a publisher takes buckets."""
    got = []
    for _ in range(0, len(stream.specs()), 3):
        got += stream.take(3)
    stream.close()
    return got


def _write(out_dir: str, weights, loss: float, grad_norm: float) -> None:
    os.makedirs(out_dir, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights}, os.path.join(out_dir, "weights.safetensors"))
    with open(os.path.join(out_dir, "step.json"), "w") as f:
        json.dump({"loss": loss, "grad_norm": grad_norm}, f)


def sgd_step(model_dir: str, dp: DataParallel, out_dir: str) -> None:
    """actor_step itself on this rank's share, the ranks' gradients summed by DataParallel, with plain SGD (its
    update is the gradient, scaled); the leader saves the updated parameters."""
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=1,
        optim={"lr": 1e-3, "grad_clip": 1e9},
    )
    model, _ = load_causal_lm(model_dir)
    full = _batch()
    mine = dp.my_rows(full.rows, full["response_length"].tolist(), 2)
    share = Batch(
        partition="train_0",
        rows=mine,
        columns={k: ([v[i] for i in mine] if isinstance(v, list) else v[mine]) for k, v in full.columns.items()},
    )
    tokens = dp.total(float(sum(float(m.sum()) for m in share["loss_mask"])))
    actor_step(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-2),
        share,
        run,
        1,
        totals=(tokens, 4.0),
        reduce_gradients=dp.sum_gradients,
    )
    if dp.is_leader:
        os.makedirs(out_dir, exist_ok=True)
        save_file(
            {n: p.detach().contiguous() for n, p in model.named_parameters()},
            os.path.join(out_dir, "weights.safetensors"),
        )


def run_case(case: dict, rank: int, master: str, pool: pathlib.Path) -> None:
    """One case on this rank: a fresh process group of the case's size, torn down after (megatron's parallel
    state with it), so the next case starts as a fresh launch would. Its files go to pool/<name>; the model is
    pool/models/<model>; `resume` names the case whose checkpoint it resumes from. Backend `actor_step`: no
    trainer backend, the data-parallel SGD step of sgd_step."""
    resume = latest_checkpoint(str(pool / case["resume"]), "actor").path if case["resume"] else ""
    dp = DataParallel(rank, case["size"], master, timeout_s=WAIT_S) if case["size"] > 1 else DataParallel()
    model_dir, out_dir = str(pool / "models" / case["model"]), str(pool / case["name"])
    if case["backend"] == "actor_step":
        sgd_step(model_dir, dp, out_dir)
    else:
        train_once(
            case["backend"],
            model_dir,
            dp,
            out_dir,
            resume,
            case["seed"],
            case["tp"],
            case["pp"],
            bool(case["sp"]),
            bool(case["lora"]),
        )
    if case["backend"] == "megatron":
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    dp.close()
    if dist.is_initialized():  # the private group a one-rank fsdp or megatron made itself (ensure_group)
        dist.destroy_process_group()


def warm(case: dict) -> None:
    """A rank whose first case is megatron's imports it while the others are still on earlier cases."""
    if case["backend"] == "megatron":
        import services.trainer.megatron_backend  # noqa: F401


if __name__ == "__main__":
    serve(run_case, warm)
