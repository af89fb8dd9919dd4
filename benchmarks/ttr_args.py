"""The command line of benchmarks/time_to_reward.py: shared flags, and per-task flags whose defaults come from
the task (benchmarks/ttr_tasks.py) unless given, when they apply to every task run."""

from __future__ import annotations

import argparse
import os

from ttr_tasks import TASKS

# flags whose default is the task's own (TaskShape field of the same name)
PER_TASK = (
    "preset",
    "steps",
    "eval_every",
    "thresholds",
    "max_new_tokens",
    "lr",
    "n_train",
    "sft_target",
    "sft_steps",
    "sft_lr",
)


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in _names(s)]


def off_policy(s: str) -> str:
    """plain | decoupled | decoupled-uncapped | tis:X (X > 0)."""
    if s in ("plain", "decoupled", "decoupled-uncapped"):
        return s
    if s.startswith("tis:"):
        try:
            if float(s[4:]) > 0:
                return s
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"{s!r}: expected plain, decoupled, decoupled-uncapped or tis:X (X > 0)")


def off_policy_settings(name: str) -> dict:
    """--off-policy -> RunConfig.algorithm fields."""
    if name == "decoupled":
        return {"decoupled": True}
    if name == "decoupled-uncapped":
        return {"decoupled": True, "behav_weight_cap": None}
    if name.startswith("tis:"):
        return {"tis_clip": float(name[4:])}
    return {}


def default_inprocess_threads() -> list[int]:
    """One core, two, and every core (the same on a 2-core machine)."""
    return sorted({1, 2, os.cpu_count() or 1})


def task_flags(p: argparse.ArgumentParser) -> None:
    t = {name: TASKS[name] for name in TASKS}
    both = lambda field: " / ".join(f"{name} {getattr(shape, field)}" for name, shape in t.items())  # noqa: E731
    p.add_argument("--preset", choices=["tiny", "mini", "small"], help=f"model shape (default: {both('preset')})")
    p.add_argument(
        "--steps", type=int, help=f"RL steps per run (default: {both('steps')}; --quick: {both('quick_steps')})"
    )
    p.add_argument("--eval-every", type=int, help=f"checkpoint + held-out eval every K steps ({both('eval_every')})")
    p.add_argument(
        "--thresholds",
        type=lambda s: [float(x) for x in _names(s)],
        help=f"held-out greedy rewards to time, comma-separated ({both('thresholds')})",
    )
    p.add_argument("--max-new-tokens", type=int, help=f"({both('max_new_tokens')})")
    p.add_argument("--lr", type=float, help=f"RL learning rate ({both('lr')})")
    p.add_argument("--n-train", type=int, help=f"training prompts ({both('n_train')})")
    p.add_argument(
        "--sft-target",
        type=float,
        help=f"the warm start stops at this greedy score on 64 training prompts ({both('sft_target')})",
    )
    p.add_argument("--sft-steps", type=int, help=f"most warm-start steps ({both('sft_steps')})")
    p.add_argument("--sft-lr", type=float, help=f"warm-start learning rate ({both('sft_lr')})")


def system_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--systems",
        type=_names,
        default=["trl", "sluice", "inprocess"],
        help="comma-separated: trl, sluice, inprocess (default all)",
    )
    p.add_argument(
        "--trl-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="TRL's torch/OpenMP/MKL threads (default: every core, os.cpu_count())",
    )
    p.add_argument(
        "--inprocess-generator",
        choices=["both", "hf", "engine"],
        default="engine",
        help="the in-process loop's generator: transformers generate, the built-in engine, or both runs",
    )
    p.add_argument(
        "--inprocess-threads",
        type=_ints,
        default=default_inprocess_threads(),
        help="torch threads of the in-process loop, a run per count (default 1, 2 and every core)",
    )
    p.add_argument("--mode", choices=["fully_async", "colocate"], default="fully_async", help="Sluice's mode")
    p.add_argument("--max-staleness", type=int, default=1, help="fully_async's staleness bound (default 1)")
    p.add_argument(
        "--off-policy",
        default="plain",
        type=off_policy,
        help="Sluice's off-policy correction: plain (PPO clip around the rollout's log-probs), "
        "decoupled (the trainer's proximal policy, behaviour weights capped at algorithm.behav_weight_cap),"
        " decoupled-uncapped, or tis:X (truncated importance sampling at X) (default plain)",
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="time_to_reward.py",
        description="Time to reward: Sluice against TRL on "
        "every core and an in-process GRPO loop, per task (see the module docstring)",
    )
    p.add_argument(
        "--tasks", type=_names, default=list(TASKS), help=f"comma-separated: {', '.join(TASKS)} (default both)"
    )
    p.add_argument("--reps", type=int, help="runs per system, one RL seed each; medians (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="smoke setting: one rep, few steps (same warm start)")
    system_flags(p)
    task_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-samples", type=int, default=8, help="group size (default 8)")
    p.add_argument("--groups", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--sft-batch-size", type=int, default=32)
    p.add_argument("--n-eval", type=int, default=128, help="held-out prompts")
    p.add_argument("--workdir", default="", help="models, checkpoints and logs (default: a new temp dir)")
    p.add_argument("--poll-ms", type=float, default=20.0)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per Sluice run, after start-up")
    args = p.parse_args(argv)
    check(p, args)
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    return args


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses what cannot run, naming the flag."""
    unknown = set(args.systems) - {"trl", "sluice", "inprocess"}
    if unknown or not args.systems:
        p.error(f"--systems: unknown {sorted(unknown)} (trl, sluice, inprocess)")
    bad_tasks = set(args.tasks) - set(TASKS)
    if bad_tasks or not args.tasks:
        p.error(f"--tasks: unknown {sorted(bad_tasks)} ({', '.join(TASKS)})")
    if (args.groups * args.n_samples) % args.micro_batch_size:
        p.error("--groups x --n-samples must be a multiple of --micro-batch-size")
    if args.trl_threads < 1 or not args.inprocess_threads or min(args.inprocess_threads) < 1:
        p.error("--trl-threads and --inprocess-threads must be >= 1")
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be >= 1")


def task_args(args: argparse.Namespace, task: str) -> argparse.Namespace:
    """args for one task: each per-task flag not given takes the task's default."""
    shape = TASKS[task]
    out = argparse.Namespace(**vars(args), task=task)
    for name in PER_TASK:
        if getattr(args, name) is None:
            value = shape.quick_steps if name == "steps" and args.quick else getattr(shape, name)
            setattr(out, name, list(value) if isinstance(value, tuple) else value)
    return out
