"""LoRA (trainer.lora, adapter-only weight sync) against full fine-tuning on the same demo run: prints ONE JSON
object on stdout (progress on stderr).

Per seed, the demo's warm-started model (services/demo.py) is trained by the demo's run (demo:reverse, 8 prompts x
8 samples a step, fully async, max_staleness 1, cosine lr decay, greedy held-out eval of 128 prompts every 5
versions; benchmarks/demo_runs.py drives it) twice: every weight at --lr, and a LoRA adapter (--rank, --alpha, the
default target modules: every attention and MLP projection) at --lora-lr. Per setting, medians over the steps of
each run, then over the seeds:

  publish_bytes          bytes a publish sends (the steps' publish_bytes metric: the adapter alone with LoRA)
  publish_s              seconds of a publish's sync (the steps' publish_s metric: the coordinator's total)
  trainer_publish_span_s the trainer's `publish` span (snapshot, send, engines' load acknowledged)
  engine_weight_load_s   the engine's `weight_load` span (with LoRA: the merge W = W0 + (alpha/r) B @ A)
  trainer_peak_rss_mb    the trainer process's peak resident memory, VmHWM of /proc/<pid>/status (the whole
                         process: Python, torch, the model, gradients and AdamW state)
  trainable_params       parameters with gradients and AdamW moments (peft's count for LoRA)
  steps_per_s, first_eval, best_eval, final_eval, steps_to_threshold (first held-out eval >= --threshold)

Usage: python benchmarks/lora_vs_full.py [--seeds 0] [--steps 200] [--rank 8 --alpha 16 --lora-lr 5e-4]
"""

from __future__ import annotations

from demo_runs import demo_args, demo_config, demo_run, log, recorded, warm_model  # sets the threads first

import argparse
import json
import os
import statistics
import sys
import tempfile


def trainable_params(model_dir: str, lora: dict | None) -> int:
    """What the trainer trains: every parameter, or the adapter's (services/trainer/lora.py's peft model)."""
    from services.model.loading import load_causal_lm
    from services.run_contract.trainer_settings import LoraSettings
    from services.trainer.lora import with_adapter

    model = load_causal_lm(model_dir)[0]
    if lora is not None:
        model = with_adapter(model, LoraSettings(**lora))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def med(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize_run(result: dict, params: int) -> dict:
    steps = result["steps"][1:]  # step 0's metrics carry no publish yet (its publish overlaps step 1)
    evals = [e for _, e in result["evals"]]
    first = result["first_at"]
    return {
        "publish_bytes": med([s["publish_bytes"] for s in steps]),
        "publish_s": round(med([s["publish_s"] for s in steps]), 4),
        "trainer_publish_span_s": result["spans"]["trainer_publish_s"],
        "engine_weight_load_s": result["spans"]["engine_weight_load_s"],
        "trainer_peak_rss_mb": result["trainer_peak_rss_mb"],
        "trainable_params": params,
        "steps_per_s": round(len(result["steps"]) / max(result["steps"][-1]["end_s"], 1e-9), 3),
        "first_eval": evals[0],
        "best_eval": max(evals),
        "final_eval": evals[-1],
        "steps_to_threshold": first["version"] if first else None,
        "exactly_once": result["exactly_once"],
        "wall_s": result["wall_s"],
        "evals": result["evals"],
    }


def over_seeds(per_seed: dict[int, dict]) -> dict:
    runs = list(per_seed.values())
    keys = [k for k in runs[0] if k not in ("evals", "exactly_once", "steps_to_threshold")]
    out = {k: med([r[k] for r in runs]) for k in keys}
    out.update(
        reached=sum(r["steps_to_threshold"] is not None for r in runs),
        seeds=len(runs),
        exactly_once=all(r["exactly_once"] for r in runs),
        per_seed=per_seed,
    )
    return out


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0", help="comma-separated demo seeds (model, warm start, prompt order)")
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--lr", type=float, default=1e-4, help="full fine-tuning's learning rate (the demo's)")
    p.add_argument("--rank", type=int, default=8, help="trainer.lora.rank")
    p.add_argument("--alpha", type=float, default=16.0, help="trainer.lora.alpha")
    p.add_argument("--lora-lr", type=float, default=5e-4, help="the LoRA run's learning rate")
    p.add_argument("--threshold", type=float, default=0.8, help="the held-out mean reward to reach")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="most seconds a run may take")
    p.add_argument(
        "--workdir",
        default="",
        help="where models, logs and each run's result go (default: a temp "
        "dir); a run whose result is there already is not run again",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="sluice-lora-")
    lora = {"rank": args.rank, "alpha": args.alpha}
    settings = {
        "full": ({"optim": {"lr": args.lr}}, None),
        "lora": ({"optim": {"lr": args.lora_lr}, "trainer": {"lora": lora}}, lora),
    }
    runs: dict[str, dict[int, dict]] = {name: {} for name in settings}
    for seed in [int(s) for s in args.seeds.split(",")]:
        demo, model = demo_args(seed, args.steps, ["--filter-groups", "none"]), None  # as measured: no filtering
        for name, (changes, adapter) in settings.items():
            where = os.path.join(work, f"seed{seed}-{name}")

            def measure() -> dict:
                nonlocal model
                model = model or warm_model(demo, os.path.join(work, f"seed{seed}"))
                run = demo_config(demo, model, where, changes)
                log(f"seed {seed}, {name}: {run.num_steps} steps, lr {run.optim.lr}")
                return summarize_run(
                    demo_run(run, where, args.threshold, args.timeout_s), trainable_params(model, adapter)
                )

            runs[name][seed] = result = recorded(where + ".json", measure)
            log(
                f"seed {seed}, {name}: publish {result['publish_bytes']} B in {result['publish_s']} s, trainer "
                f"peak {result['trainer_peak_rss_mb']} MiB, held-out {result['first_eval']} -> {result['best_eval']}"
            )
    out = {
        "benchmark": "lora_vs_full",
        "task": "demo:reverse",
        "config": vars(args),
        "cpus": os.cpu_count(),
        "settings": {name: over_seeds(runs[name]) for name in settings},
    }
    full, adapter = out["settings"]["full"], out["settings"]["lora"]
    out["lora_over_full"] = {
        k: round(adapter[k] / full[k], 4)
        for k in ("publish_bytes", "publish_s", "trainer_peak_rss_mb", "trainable_params")
        if adapter[k] and full[k]
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
