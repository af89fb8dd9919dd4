"""The staleness study: how much Sluice learns per step as the rollout runs further ahead, per off-policy
correction. Runs benchmarks/time_to_reward.py's Sluice system (`--systems sluice`) once per (max_staleness,
--off-policy) pair, each over --reps seeds, on one task, and prints ONE JSON object on stdout (progress on stderr):

  runs[i]        max_staleness, off_policy, and over the reps (medians):
                   steps_to_reward   the first evaluated step whose held-out greedy score reaches each threshold
                   eval_mean         the mean held-out score over every evaluated step after step 0 (the area
                                     under the eval curve: learning per step, one number)
                   final_eval        the held-out score after the last step
                   train_reward      the mean train reward over each third of the run's steps
                   steps_per_s, max_staleness_seen
                   per_rep           eval_mean and final_eval of each seed
  vs_staleness   per off_policy: eval_mean at each max_staleness over its eval_mean at the smallest one run
                 (issue #36: decoupled at 8 within 5% of 2 on the short task)

Learning per step does not depend on the machine's speed, only the realised staleness does (a slower trainer
lets the rollout run ahead up to the bound): compare within one run of this script.

Usage: python benchmarks/staleness_study.py [--task short] [--staleness 0,1,2,4,8]
           [--off-policy plain,decoupled,tis:2] [--reps 3] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def one_setting(args, staleness: int, off_policy: str) -> dict:
    """time_to_reward.py for one (max_staleness, off_policy) pair: its sluice block."""
    cmd = [
        sys.executable,
        os.path.join(HERE, "time_to_reward.py"),
        "--systems",
        "sluice",
        "--tasks",
        args.task,
        "--off-policy",
        off_policy,
        "--reps",
        str(args.reps),
        "--seed",
        str(args.seed),
    ]
    cmd += ["--mode", "colocate"] if staleness == 0 else ["--max-staleness", str(staleness)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    log(f"max_staleness {staleness}, {off_policy}: {' '.join(cmd[2:])}")
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"time_to_reward.py failed (exit {done.returncode}) at max_staleness {staleness}, {off_policy}"
        )
    return json.loads(done.stdout)["tasks"][args.task]["sluice"]


def curve_summary(curve: list[dict]) -> dict:
    """A rep's curve -> eval_mean, final_eval, and its train reward's mean per third of the steps."""
    evals = [p["eval_reward"] for p in curve if p["step"] > 0 and p["eval_reward"] is not None]
    train = [p["train_reward"] for p in curve if p["step"] > 0 and p["train_reward"] is not None]
    third = max(1, len(train) // 3)
    thirds = [train[i * third : (i + 1) * third] for i in range(3)]
    return {
        "eval_mean": statistics.fmean(evals),
        "final_eval": evals[-1],
        "train_reward": [round(statistics.fmean(t), 4) if t else None for t in thirds],
    }


def setting_result(block: dict, staleness: int, off_policy: str) -> dict:
    reps = block.get("reps", [block])
    per_rep = [{"seed": r["seed"], **curve_summary(r["curve"])} for r in reps]
    med = lambda key: round(statistics.median(r[key] for r in per_rep), 4)  # noqa: E731
    train = [
        round(statistics.median(r["train_reward"][i] for r in per_rep if r["train_reward"][i] is not None), 4)
        for i in range(3)
    ]
    return {
        "max_staleness": staleness,
        "off_policy": off_policy,
        "steps_to_reward": block["steps_to_reward"],
        "eval_mean": med("eval_mean"),
        "final_eval": med("final_eval"),
        "train_reward": train,
        "steps_per_s": block["steps_per_s"],
        "max_staleness_seen": max(r["max_staleness_seen"] for r in reps),
        "per_rep": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "train_reward"}
            for r in per_rep
        ],
    }


def relative(runs: list[dict]) -> dict:
    """Per off_policy: eval_mean at each staleness over eval_mean at the smallest staleness run."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["off_policy"] for r in runs):
        mine = sorted((r for r in runs if r["off_policy"] == name), key=lambda r: r["max_staleness"])
        base = mine[0]["eval_mean"]
        out[name] = {str(r["max_staleness"]): round(r["eval_mean"] / base, 3) if base else None for r in mine}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="staleness_study.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="short", help="a time_to_reward.py task (default short: the tiny-step one)")
    p.add_argument(
        "--staleness",
        default="1,2,4,8",
        help="max_staleness values, comma-separated; 0 = colocate (on-policy) (default 1,2,4,8)",
    )
    p.add_argument(
        "--off-policy",
        default="plain,decoupled,tis:2",
        help="time_to_reward.py --off-policy values, comma-separated (default plain,decoupled,tis:2)",
    )
    p.add_argument("--reps", type=int, default=3, help="seeds per setting (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="steps per run (default: the task's)")
    args = p.parse_args(argv)
    stalenesses = [int(s) for s in args.staleness.split(",") if s.strip()]
    if not stalenesses or min(stalenesses) < 0:
        p.error("--staleness: values must be >= 0 (0: colocate, on-policy)")
    runs = [
        setting_result(one_setting(args, s, op), s, op)
        for op in [o.strip() for o in args.off_policy.split(",") if o.strip()]
        for s in stalenesses
    ]
    for r in runs:
        log(
            f"max_staleness {r['max_staleness']} {r['off_policy']}: eval_mean {r['eval_mean']}, final "
            f"{r['final_eval']}, steps/s {r['steps_per_s']}"
        )
    print(
        json.dumps(
            {
                "benchmark": "staleness_study",
                "task": args.task,
                "reps": args.reps,
                "seed": args.seed,
                "runs": runs,
                "vs_staleness": relative(runs),
                "runtime_s": round(time.perf_counter() - _T0, 1),
            },
            indent=2,
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
