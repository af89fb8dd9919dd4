"""Trainer backends benchmark: prints one JSON object to stdout (progress goes to stderr).

The actor's optimizer step (services/trainer/actor_update.py: PPO loss, AdamW, clipping) on a fixed synthetic
global batch, per backend, each rank its own process with one torch thread:

    torch x1   the whole model in one process (the baseline)
    torch x2   two data-parallel ranks, whole model on each, gradients summed (all-reduce over gloo)
    fsdp  x2   two FSDP2 ranks: parameters, gradients and AdamW moments sharded
    megatron tp2  megatron-core with tensor parallelism 2 (DistributedOptimizer, forward-backward schedule)
    megatron pp2  megatron-core with pipeline parallelism 2

Per configuration: the median step wall time over --steps steps after --warmup, and per rank the bytes of its
model state (its local parameters + gradients + optimizer state, measured from the tensors after a step) and
its peak resident memory (ru_maxrss, which also holds the Python runtime, torch and the activations). Target
(issue: trainer backends): fsdp's model state per rank <= 0.6x the torch backend's. No step-time target on
CPU: two ranks share this machine's two cores with everything else.

Usage: python benchmarks/trainer_backends.py [--preset small] [--steps 8] [--warmup 2]
Internal mode: --worker --backend B --rank R --size N --master H:P --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = [("torch", 1, 1, 1), ("torch", 2, 1, 1), ("fsdp", 2, 1, 1), ("megatron", 2, 2, 1), ("megatron", 2, 1, 2)]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synthetic_batch(samples: int, prompt: int, response: int, vocab: int):
    import torch

    from services.transferqueue.codec import Batch

    g = torch.Generator().manual_seed(0)
    return Batch(
        partition="train_0",
        rows=list(range(samples)),
        columns={
            "tokens": [torch.randint(3, vocab, (prompt + response,), generator=g) for _ in range(samples)],
            "prompt_length": torch.full((samples,), prompt),
            "response_length": torch.full((samples,), response),
            "loss_mask": [torch.ones(response) for _ in range(samples)],
            "rollout_log_probs": [-5.0 + 0.1 * torch.randn(response, generator=g) for _ in range(samples)],
            "advantages": [torch.full((response,), 1.0 if i % 2 else -1.0) for i in range(samples)],
        },
    )


def state_bytes(backend) -> int:
    """This rank's parameters, gradients and optimizer state as stored here (a DTensor counts its shard).
    Gradients count at their parameter's size: they live through the step (actor_step frees them after);
    megatron's are its DDP buffer (float32) and its optimizer's state includes the float32 main parameters."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    if backend.name == "megatron":
        params = list(backend.model.module.parameters())
        total = sum(p.numel() * p.element_size() * 2 for p in params)
        inner = (
            backend.optimizer.chained_optimizers[0].optimizer
            if hasattr(backend.optimizer, "chained_optimizers")
            else backend.optimizer.optimizer
        )
        states = inner.state.values()
    else:
        total = sum(2 * local(p).numel() * p.element_size() for p in backend.policy.parameters())
        states = backend.optimizer.state.values()
    for state in states:
        total += sum(local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def worker(a) -> None:
    import torch

    from services.model.loading import load_causal_lm
    from services.run_contract.run_config import RunConfig
    from services.trainer.backend import make_backend
    from services.trainer.data_parallel import DataParallel
    from services.transferqueue.codec import Batch

    torch.set_num_threads(1)
    dp = DataParallel(a.rank, a.size, a.master, timeout_s=600)
    run = RunConfig(
        name="bench",
        model=a.model,
        n_samples_per_prompt=2,
        rollout_batch_size=a.samples // 2,
        global_batch_size=a.samples,
        micro_batch_size=a.micro,
        optim={"lr": 1e-5},
    )
    model, _ = load_causal_lm(a.model)
    backend = make_backend(a.backend, model, run, "cpu", dp, tp=a.tp, pp=a.pp)
    full = synthetic_batch(a.samples, a.prompt, a.response, model.config.vocab_size)
    mine = dp.my_rows(full.rows, full["response_length"].tolist(), 2, backend.data_rank, backend.data_size)
    share = Batch(
        partition="train_0",
        rows=mine,
        columns={k: ([v[i] for i in mine] if isinstance(v, list) else v[mine]) for k, v in full.columns.items()},
    )
    tokens = dp.total(float(sum(float(m.sum()) for m in share["loss_mask"]))) / (dp.size // backend.data_size)
    times = []
    for step in range(a.warmup + a.steps):
        dp.barrier()
        start = time.perf_counter()
        backend.train(share, run, run.micro_batch_size, totals=(tokens, float(a.samples)))
        dp.barrier()
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    state = dp.total(float(state_bytes(backend))) / dp.size  # mean over ranks (they differ by a shard's rounding)
    rss = dp.total(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0) / dp.size
    if dp.is_leader:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "step_s": statistics.median(times),
                    "steps_s": times,
                    "state_bytes_per_rank": state,
                    "max_rss_bytes_per_rank": rss,
                },
                f,
            )
    dp.close()


def run_config(a, backend: str, size: int, tp: int, pp: int, workdir: str) -> dict:
    from services.runtime.processes import free_port

    out = os.path.join(workdir, f"{backend}-{size}-{tp}-{pp}.json")
    master = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--backend",
        backend,
        "--size",
        str(size),
        "--master",
        master,
        "--out",
        out,
        "--model",
        a.model,
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--samples",
        str(a.samples),
        "--micro",
        str(a.micro),
        "--prompt",
        str(a.prompt),
        "--response",
        str(a.response),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
    ]
    procs = [subprocess.Popen(argv + ["--rank", str(r)], env=env) for r in range(size)]
    codes = [p.wait(1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"{backend} x{size}: exit codes {codes}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    p.add_argument("--samples", type=int, default=16, help="global batch: samples (default 16)")
    p.add_argument("--micro", type=int, default=4, help="micro batch size per rank (default 4)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sample (default 32)")
    p.add_argument("--response", type=int, default=32, help="response tokens per sample (default 32)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--backend", "--master", "--out", "--model"):
        p.add_argument(flag, default="", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    from services.model.init_model import init_model

    workdir = tempfile.mkdtemp(prefix="sluice-trainer-bench-")
    a.model = init_model(os.path.join(workdir, "model"), preset=a.preset, arch="qwen2", seed=0)
    results = {}
    for backend, size, tp, pp in CONFIGS:
        name = f"{backend}_x{size}" + (f"_tp{tp}_pp{pp}" if backend == "megatron" else "")
        log(f"{name} ...")
        results[name] = run_config(a, backend, size, tp, pp, workdir)
        log(f"{name}: step {results[name]['step_s']:.3f} s")
    ratio = results["fsdp_x2"]["state_bytes_per_rank"] / results["torch_x1"]["state_bytes_per_rank"]
    print(
        json.dumps(
            {
                "benchmark": "trainer_backends",
                "config": {
                    "preset": a.preset,
                    "steps": a.steps,
                    "warmup": a.warmup,
                    "global_batch": a.samples,
                    "micro_batch": a.micro,
                    "tokens_per_sample": a.prompt + a.response,
                    "torch_threads": 1,
                },
                "results": results,
                "fsdp_x2_state_per_rank_vs_torch": round(ratio, 3),
                "target": {"fsdp_x2_state_per_rank_vs_torch_max": 0.6, "met": ratio <= 0.6},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
