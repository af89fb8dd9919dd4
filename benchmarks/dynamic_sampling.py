"""Dynamic sampling (DAPO, rollout.filter_groups) on the demo: prints ONE JSON object on stdout (progress on stderr).

For each seed, the demo's warm-started model (services/demo.py, the same for both settings of a seed) is trained by
the demo's run (demo:reverse, 8 prompts x 8 samples a step, fully async, max_staleness 1, lr 1e-4 on a cosine decay,
greedy held-out eval of 128 prompts every 5 versions) once with `rollout.filter_groups: none` and once with
`zero_variance` (benchmarks/demo_runs.py drives it). Per setting, medians over the seeds:

  zero_variance_trained   share of the trained groups whose rewards were all equal (GRPO's advantage 0: they
                          teach nothing), over all steps and per tenth of the run
  filtered_share          share of the generated groups dynamic sampling dropped: f / (f + G) per step, f the
                          step's filtered_groups, G = 8 (0 without filtering: then every generated group trains)
  steps_to_threshold      the first held-out eval >= --threshold (0.8): its version = steps trained (None: not
                          reached; the median counts a miss as above every step)
  seconds_to_threshold    its seconds after step 0 ended (machine load moves these; steps do not)
  best_eval, final_eval, steps_per_s, exactly_once, max_staleness_seen
  per_seed                the same per seed

Learning per step does not depend on the machine's load (the staleness realised does a little): compare steps.

Usage: python benchmarks/dynamic_sampling.py [--seeds 0,1,2] [--steps 300] [--settings none,zero_variance]
"""

from __future__ import annotations

from demo_runs import demo_args, demo_config, demo_run, log, recorded, warm_model  # sets the threads first

import argparse
import json
import os
import statistics
import sys
import tempfile


def share(parts: list[tuple[int, int]]) -> float | None:
    """sum of numerators / sum of denominators of (numerator, denominator) pairs."""
    total = sum(d for _, d in parts)
    return round(sum(n for n, _ in parts) / total, 4) if total else None


def by_tenth(values: list, num_steps: int) -> list:
    """`values` (one (n, d) pair per step, in step order) -> the share within each tenth of the run."""
    size = max(1, num_steps // 10)
    return [share(values[i : i + size]) for i in range(0, len(values), size)]


def summarize_run(result: dict, groups_per_step: int) -> dict:
    steps = result["steps"]
    zero = [(z["zero_variance"], z["groups"]) for _, z in sorted(result["zero_variance"].items())]
    filtered = [(s["filtered_groups"], s["filtered_groups"] + groups_per_step) for s in steps]
    evals = [e for _, e in result["evals"]]
    first = result["first_at"]
    return {
        "zero_variance_trained": share(zero),
        "zero_variance_trained_by_tenth": by_tenth(zero, len(steps)),
        "filtered_share": share(filtered),
        "filtered_share_by_tenth": by_tenth(filtered, len(steps)),
        "filtered_groups_total": sum(n for n, _ in filtered),
        "steps_to_threshold": first["version"] if first else None,
        "seconds_to_threshold": first["seconds"] if first else None,
        "best_eval": max(evals),
        "final_eval": evals[-1],
        "first_eval": evals[0],
        "steps_per_s": round(len(steps) / max(steps[-1]["end_s"], 1e-9), 3),
        "max_staleness_seen": max(s["staleness_max"] for s in steps),
        "exactly_once": result["exactly_once"],
        "wall_s": result["wall_s"],
        "logged_steps": len(zero),
        "evals": result["evals"],
    }


def median(values: list, missing_as: float | None = None) -> float | None:
    """Median of the known values; with `missing_as`, a None counts as that value (a threshold never reached)."""
    known = (
        [missing_as if v is None else v for v in values]
        if missing_as is not None
        else [v for v in values if v is not None]
    )
    return statistics.median(known) if known else None


def over_seeds(per_seed: dict[int, dict], num_steps: int) -> dict:
    runs = list(per_seed.values())
    out = {
        key: median([r[key] for r in runs])
        for key in (
            "zero_variance_trained",
            "filtered_share",
            "seconds_to_threshold",
            "best_eval",
            "final_eval",
            "steps_per_s",
        )
    }
    steps = median([r["steps_to_threshold"] for r in runs], missing_as=num_steps + 1)
    out.update(
        steps_to_threshold=None if steps is None or steps > num_steps else steps,
        reached=sum(r["steps_to_threshold"] is not None for r in runs),
        seeds=len(runs),
        exactly_once=all(r["exactly_once"] for r in runs),
        max_staleness_seen=max(r["max_staleness_seen"] for r in runs),
        zero_variance_trained_by_tenth=[
            median(col) for col in zip(*(r["zero_variance_trained_by_tenth"] for r in runs))
        ],
        filtered_share_by_tenth=[median(col) for col in zip(*(r["filtered_share_by_tenth"] for r in runs))],
        per_seed=per_seed,
    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated demo seeds (model, warm start, prompt order)")
    p.add_argument("--steps", type=int, default=300, help="training steps per run (the demo's default)")
    p.add_argument("--settings", default="none,zero_variance", help="rollout.filter_groups values to compare")
    p.add_argument("--threshold", type=float, default=0.8, help="the held-out mean reward to reach")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="most seconds a run may take")
    p.add_argument(
        "--workdir",
        default="",
        help="where models, logs and each run's result go (default: a temp "
        "dir); a run whose result is there already is not run again",
    )
    args = p.parse_args(argv)
    seeds, settings = [int(s) for s in args.seeds.split(",")], args.settings.split(",")
    work = args.workdir or tempfile.mkdtemp(prefix="sluice-dynamic-sampling-")
    runs: dict[str, dict[int, dict]] = {s: {} for s in settings}
    for seed in seeds:
        demo, model = demo_args(seed, args.steps), None
        for setting in settings:
            where = os.path.join(work, f"seed{seed}-{setting}")

            def measure() -> dict:
                nonlocal model
                model = model or warm_model(demo, os.path.join(work, f"seed{seed}"))
                run = demo_config(demo, model, where, {"rollout": {"filter_groups": setting}})
                log(f"seed {seed}, filter_groups {setting}: {run.num_steps} steps")
                return summarize_run(demo_run(run, where, args.threshold, args.timeout_s), run.rollout_batch_size)

            runs[setting][seed] = result = recorded(where + ".json", measure)
            log(
                f"seed {seed}, {setting}: 0.8 at step {result['steps_to_threshold']}, zero-variance trained "
                f"{result['zero_variance_trained']}, filtered {result['filtered_share']}, best {result['best_eval']}, "
                f"{result['wall_s']} s"
            )
    out = {
        "benchmark": "dynamic_sampling",
        "task": "demo:reverse",
        "config": vars(args),
        "cpus": os.cpu_count(),
        "settings": {s: over_seeds(runs[s], args.steps) for s in settings},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
