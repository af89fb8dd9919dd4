"""One actor rank of a trainer backend for test_trainer_backends: one optimizer step (AdamW, gradient clipping) on
its share of a fixed global batch, then (leader) the step's loss and gradient norm, a checkpoint of the gathered
state and the updated weights. With --resume, the model and optimizer state come from a checkpoint first."""

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from services.run_contract.checkpoint import save_checkpoint
from services.run_contract.run_config import RunConfig
from services.trainer.backend import make_backend
from services.trainer.data_parallel import DataParallel
from services.trainer.lora import load_actor
from services.transferqueue.codec import Batch
from tests.trainer.test_actor_update import _batch

RUN = dict(name="r", n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4, micro_batch_size=1,
           optim={"lr": 1e-3, "grad_clip": 0.5})  # Adam moves every weight by ~lr
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "o_proj", "up_proj"]}


def train_once(backend: str, model_dir: str, dp: DataParallel, out_dir: str, resume: str = "", seed: int = 0,
               tp: int = 1, pp: int = 1, sp: bool = False, lora: bool = False):
    run = RunConfig(model=model_dir, **RUN, trainer={"lora": LORA if lora else None})
    torch.manual_seed(0)  # a fresh adapter's initial A
    model = load_actor(run, resume or None, "float32", "cpu")
    b = make_backend(backend, model, run, "cpu", dp, tp=tp, pp=pp, sequence_parallel=sp)
    if resume:
        b.load_optimizer(resume)
    full = _batch(seed)
    mine = dp.my_rows(full.rows, full["response_length"].tolist(), 2, b.data_rank, b.data_size)
    share = Batch(partition="train_0", rows=mine, columns={
        k: ([v[i] for i in mine] if isinstance(v, list) else v[mine]) for k, v in full.columns.items()})
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


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--backend", "--master", "--out", "--resume"):
        p.add_argument(flag, default="")
    for flag in ("--rank", "--size", "--seed", "--tp", "--pp"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--sp", type=int, default=0)
    p.add_argument("--lora", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    dp = DataParallel(a.rank, a.size, a.master, timeout_s=120)
    train_once(a.backend, a.model, dp, a.out, a.resume, a.seed, a.tp, a.pp, bool(a.sp), bool(a.lora))
    dp.close()


if __name__ == "__main__":
    main()
