"""Where a fully-async step's wall time goes, service by service: prints one JSON object to stdout, writes a
Gantt chart PNG and the same JSON to --out (progress goes to stderr).

Runs one short fully-async RL run on this machine (services/launch/local_run.py: private Redis, TransferQueue,
coordinator, --engines built-in engines, rollout, advantage, trainer, each its own process, one torch thread
each; GRPO on demo:letters with a random `sluice init-model` model), then reads every service's recorded spans
(GET /spans: generate, reward, put, claim, forward, advantage, train, checkpoint, publish, weight_load, pause)
and reports, over the steady state (steps [--warmup, --steps)):

  steps           per step: wall time (end of the previous publish to the end of its own), the trainer's
                  seconds by phase (claim = waiting for data, train, publish, ...), and every other service's
                  busy seconds in that window;
  overlap         each service's busy seconds and busy fraction of the window, the ideal-overlap bound
                  (sum of busy / max busy) and how much of it the run reached (services/tracking/timeline.py).

The PNG: one lane per service, working spans coloured by name, waiting grey.

Usage: python benchmarks/step_timeline.py [--steps 8] [--warmup 2] [--out DIR]
The tiny-step shape of time_to_reward.py's short task (issue #36's per-step budget):
       python benchmarks/step_timeline.py --preset mini --groups-per-step 8 --n-samples 8 --max-new-tokens 6 \
           --micro-batch-size 32 --lr 1e-3 --steps 60 --warmup 10
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from services.run_contract.run_config import RunConfig  # noqa: E402
from services.launch.local_run import LocalRun  # noqa: E402
from services.tracking.timeline import draw_gantt, fetch_spans, overlap_summary, step_table  # noqa: E402
from services.model.init_model import init_model  # noqa: E402

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def build_run(args, model_dir: str) -> RunConfig:
    rows = args.groups_per_step * args.n_samples
    return RunConfig(
        name="step-timeline",
        model=model_dir,
        mode="fully_async",
        max_staleness=args.max_staleness,
        n_samples_per_prompt=args.n_samples,
        rollout_batch_size=args.groups_per_step,
        global_batch_size=rows,
        micro_batch_size=args.micro_batch_size or min(rows, 8),
        num_steps=args.steps,
        algorithm={"estimator": "grpo"},
        rollout={
            "prompts": "demo:letters",
            "max_new_tokens": args.max_new_tokens,
            "max_groups_in_flight": args.max_groups_in_flight,
        },
        optim={"lr": args.lr},
    )


def run_once(args, work: str) -> dict[str, list[dict]]:
    model_dir = init_model(os.path.join(work, "model"), preset=args.preset, arch="qwen2", seed=0)
    with LocalRun(build_run(args, model_dir), log_dir=os.path.join(work, "logs"), engines=args.engines) as local:
        log(f"stack up; logs in {local.log_dir}")
        local.wait_for_step(args.steps, timeout_s=args.timeout_s)
        log("run finished; reading spans")
        spans = fetch_spans(local.service_urls())
    return spans


def summarize(args, spans: dict[str, list[dict]]) -> dict:
    steps = step_table(spans)
    measured = [s for s in steps if s["step"] is not None and s["step"] >= args.warmup]
    if not measured:
        raise RuntimeError(f"no steps past the warm-up were recorded ({len(steps)} steps)")
    start, end = measured[0]["start"], measured[-1]["start"] + measured[-1]["wall_s"]
    overlap = overlap_summary(spans, start, end)
    mean_wall = sum(s["wall_s"] for s in measured) / len(measured)
    trainer_phases = {}
    for s in measured:
        for k, v in s["trainer_s"].items():
            trainer_phases[k] = trainer_phases.get(k, 0.0) + v / len(measured)
    return {
        "benchmark": "step_timeline",
        "mean_step_s": round(mean_wall, 3),
        "trainer_mean_s": {k: round(v, 3) for k, v in sorted(trainer_phases.items())},
        "overlap": overlap,
        "steps": [{k: v for k, v in s.items() if k != "start"} for s in steps],
        "window": [start, end],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the summary (start-up)")
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument(
        "--max-groups-in-flight",
        type=int,
        default=0,
        help="rollout.max_groups_in_flight (0 = the run default, 2 steps' worth)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--preset", choices=["mini", "tiny", "small"], default="tiny")
    p.add_argument("--micro-batch-size", type=int, default=0, help="the trainer's micro batch (0 = min(rows, 8))")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", default=None, help="directory for timeline.png and timeline.json (default: a temp dir)")
    args = p.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="sluice-timeline-")
    os.makedirs(out, exist_ok=True)
    spans = run_once(args, tempfile.mkdtemp(prefix="sluice-timeline-run-"))
    result = summarize(args, spans)
    result["config"] = vars(args)
    start, end = result.pop("window")
    draw_gantt(
        spans,
        os.path.join(out, "timeline.png"),
        start,
        end,
        title=f"fully-async, steps {args.warmup}-{args.steps - 1}: mean step {result['mean_step_s']} s",
    )
    result["png"] = os.path.join(out, "timeline.png")
    with open(os.path.join(out, "timeline.json"), "w") as f:
        json.dump({**result, "spans": spans}, f)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
