"""`sluice demo`: a whole RL run on this machine, every service its own process.

Writes a tiny random model (or uses --model), starts a private Redis, TransferQueue, the coordinator,
built-in engines and the roles the run needs (services/launch/local_run.py), submits the run, prints
one JSON line per finished step and a JSON summary, and checks that every sample was trained exactly
once within the staleness bound. Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from services.algorithms.advantages import ESTIMATORS
from services.run_contract.run_config import RunConfig
from services.launch.local_run import LocalRun
from services.model.init_model import init_model

_SHOWN = ("weight_version", "reward_mean", "loss", "clip_fraction", "entropy", "grad_norm", "staleness",
          "rollout_logprob_abs_diff", "tokens_per_s", "wait_s")


def build_run(args, model_dir: str) -> RunConfig:
    rows = args.groups_per_step * args.n_samples
    return RunConfig(name="demo", model=model_dir, mode=args.mode,
                     max_staleness=0 if args.mode == "colocate" else args.max_staleness,
                     n_samples_per_prompt=args.n_samples, rollout_batch_size=args.groups_per_step,
                     global_batch_size=rows, micro_batch_size=min(rows, 8) if rows % min(rows, 8) == 0 else rows,
                     num_steps=args.steps, checkpoint_interval=args.checkpoint_interval,
                     algorithm={"estimator": args.estimator}, rollout={"prompts": args.prompts,
                                                                      "max_new_tokens": args.max_new_tokens},
                     optim={"lr": args.lr})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="training steps")
    parser.add_argument("--mode", choices=["fully_async", "colocate"], default="fully_async")
    parser.add_argument("--max-staleness", type=int, default=1, help="versions rollout may run ahead (fully_async)")
    parser.add_argument("--estimator", default="grpo",
                        choices=ESTIMATORS)
    parser.add_argument("--prompts", default="demo:letters", help="demo:<task>, a .jsonl or a .parquet file")
    parser.add_argument("--groups-per-step", type=int, default=4, help="prompt groups per step")
    parser.add_argument("--n-samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--engines", type=int, default=1, help="built-in engine processes")
    parser.add_argument("--model", default="", help="a local HF model directory; default: a new tiny random model")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="size of the random model")
    parser.add_argument("--workdir", default="", help="where model, logs and checkpoints go (default: a temp dir)")
    parser.add_argument("--checkpoint-interval", type=int, default=0, help="checkpoint every N steps; 0 = never")
    parser.add_argument("--timeout-s", type=float, default=1800)
    args = parser.parse_args(argv)

    workdir = args.workdir or tempfile.mkdtemp(prefix="sluice-demo-")
    os.makedirs(workdir, exist_ok=True)
    model_dir = args.model or init_model(os.path.join(workdir, "model"), preset=args.preset)
    run = build_run(args, model_dir)
    started = time.monotonic()
    print(json.dumps({"event": "starting", "workdir": workdir, "logs": os.path.join(workdir, "logs")}), flush=True)
    with LocalRun(run, log_dir=os.path.join(workdir, "logs"), engines=args.engines,
                  checkpoint_dir=os.path.join(workdir, "checkpoints") if args.checkpoint_interval else None) as local:
        print(json.dumps({"event": "running", "startup_s": round(time.monotonic() - started, 1),
                          "services": sorted(local.procs)}), flush=True)
        t0 = time.monotonic()
        shown = 0
        while shown < run.num_steps:
            local.wait_for_step(shown + 1, args.timeout_s)
            steps = local.trained_steps()
            while shown in steps:
                m = steps[shown]["metrics"]
                print(json.dumps({"step": shown, **{k: m[k] for k in _SHOWN if k in m}}), flush=True)
                shown += 1
        wall = time.monotonic() - t0
        steps = local.trained_steps()
    samples = [s for rec in steps.values() for s in rec["samples"]]
    stale = max(int(k) for rec in steps.values() for k in rec["metrics"]["staleness"])
    summary = {"event": "finished", "steps": run.num_steps, "samples": len(samples), "wall_s": round(wall, 2),
               "samples_per_s": round(len(samples) / wall, 2), "max_staleness_seen": stale,
               "every_sample_once": len(samples) == len(set(samples)) == run.num_steps * run.rows_per_step}
    print(json.dumps(summary), flush=True)
    return 0 if summary["every_sample_once"] and stale <= run.max_staleness else 1


if __name__ == "__main__":
    sys.exit(main())
