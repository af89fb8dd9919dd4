"""One data-parallel actor rank for test_data_parallel: trains its share of a fixed global batch and
(rank 0) saves the updated parameters."""

import argparse

import torch
from safetensors.torch import save_file

from services.run_contract.run_config import RunConfig
from services.model.loading import load_causal_lm
from services.trainer.actor_update import actor_step
from services.trainer.data_parallel import DataParallel
from services.transferqueue.codec import Batch
from tests.trainer.test_actor_update import _batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model"), p.add_argument("--rank", type=int), p.add_argument("--size", type=int)
    p.add_argument("--master"), p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    dp = DataParallel(a.rank, a.size, a.master, timeout_s=120)
    run = RunConfig(name="r", model=a.model, n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4,
                    micro_batch_size=1, optim={"lr": 1e-3, "grad_clip": 1e9})
    model, _ = load_causal_lm(a.model)
    full = _batch()
    mine = dp.my_rows(full.rows, full["response_length"].tolist(), 2)
    share = Batch(partition="train_0", rows=mine, columns={
        k: ([v[i] for i in mine] if isinstance(v, list) else v[mine]) for k, v in full.columns.items()})
    tokens = dp.total(float(sum(float(m.sum()) for m in share["loss_mask"])))
    actor_step(model, torch.optim.SGD(model.parameters(), lr=1e-2), share, run, 1, totals=(tokens, 4.0),
               reduce_gradients=dp.sum_gradients)
    if dp.is_leader:
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, a.out)
    dp.close()


if __name__ == "__main__":
    main()
