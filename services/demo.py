"""`sluice demo`: a whole RL run on this machine that visibly learns, every service its own process.

The default task, demo:reverse ("Reverse: d a c b" -> "b c a d", exact-match reward), starts from a new
random Qwen2 of ~3.4M parameters (`--preset small`), warm-starts it with a few seconds of supervised
fine-tuning (services/demo_tasks/warm_start.py, stopped once it answers --warm-start-target of 64 training
prompts; held-out reward ~0.2), then runs fully-async GRPO (the learning rate on a cosine decay to 0.1x;
DAPO's dynamic sampling drops the groups whose 8 rewards are all equal, which would train nothing) as `sluice
run` would a run file (services/front_door/supervisor.py: a private Redis, TransferQueue, the
coordinator, a built-in engine, rollout, advantage and trainer). The rollout scores 128 held-out prompts
greedily every --eval-every versions; the held-out reward (`eval_reward`) climbs past 0.8. Shown as a live
panel on a terminal, one JSON line per trained step and a JSON summary otherwise; TensorBoard events and the
report (PNG + summary) go to the run directory under --workdir. The summary also says whether every sample
was trained exactly once within the staleness bound. Ctrl-C pauses and stops everything.

`sluice demo --task` lists the built-in tasks and what each teaches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from services.algorithms.names import ESTIMATORS
from services.demo_tasks import DEMO_TASKS
from services.runtime.settings_cli import HelpWithDefaults
from services.front_door.follower import RunProgress
from services.front_door.run_file import RunFile
from services.front_door.supervisor import RunOptions, start_and_follow
from services.launch.local_run import LocalRun

WARM_STARTED = {"reverse"}  # tasks a random model cannot score on at all (every group's rewards equal)


def build_run(args, model_dir: str, workdir: str) -> RunFile:
    rows = args.groups_per_step * args.n_samples
    micro = next(m for m in (32, 16, 8, 4, 2, 1) if rows % m == 0)
    prompts = args.prompts or f"demo:{args.task}"
    return RunFile(
        name="demo",
        model=model_dir,
        mode=args.mode,
        max_staleness=0 if args.mode == "colocate" else args.max_staleness,
        n_samples_per_prompt=args.n_samples,
        rollout_batch_size=args.groups_per_step,
        global_batch_size=rows,
        micro_batch_size=micro,
        num_steps=args.steps,
        checkpoint={"interval": args.checkpoint_interval},
        algorithm={"estimator": args.estimator, "kl_coef": 0.0},
        rollout={
            "prompts": prompts,
            "max_new_tokens": args.max_new_tokens,
            "shuffle_seed": args.seed,
            "temperature": args.temperature,
            "agent": DEMO_TASKS[args.task].agent,
            "filter_groups": args.filter_groups or DEMO_TASKS[args.task].filter_groups,
        },
        eval={
            "prompts": prompts
            if prompts.startswith("demo:") and args.eval_every and not DEMO_TASKS[args.task].agent
            else None,  # eval makes plain completions
            "every_n_versions": max(1, args.eval_every),
            "max_prompts": args.eval_prompts,
            "temperature": 0.0,
        },
        optim={"lr": args.lr, "seed": args.seed, "lr_schedule": args.lr_schedule, "min_lr_ratio": args.min_lr_ratio},
        stack={
            "engines": args.engines,
            "output_dir": workdir,
            "log_dir": os.path.join(workdir, "logs"),
            "checkpoint_dir": os.path.join(workdir, "checkpoints"),
            "coordinator_port": args.coordinator_port,
        },
    )


def exactly_once(local: LocalRun, progress: RunProgress) -> None:
    """Every sample of every step trained so far trained exactly once, none past max_staleness, and a finished
    run trained every step (else the demo fails). Also for a run interrupted or stopped early: its steps."""
    run = local.run
    steps = local.trained_steps()
    if not steps and progress.state != "finished":
        return  # stopped before its first step: nothing to check
    samples = [s for rec in steps.values() for s in rec["samples"]]
    stale = max(int(k) for rec in steps.values() for k in rec["metrics"]["staleness"])
    expected = (run.num_steps if progress.state == "finished" else len(steps)) * run.rows_per_step
    once = len(samples) == len(set(samples)) == expected
    progress.extra.update(samples=len(samples), max_staleness_seen=stale, every_sample_once=once)
    if not once or stale > run.max_staleness:
        progress.state = "failed"
        progress.failure = (
            f"samples trained: {len(samples)}, distinct: {len(set(samples))}, expected: {expected}; "
            f"max staleness seen {stale}"
        )


def prepare_model(args, workdir: str) -> str:
    """--model as it is, or a new random model, warm-started for the tasks that need it."""
    if args.model:
        return args.model
    from services.model.init_model import init_model  # torch and transformers: only when needed

    base = init_model(os.path.join(workdir, "model"), preset=args.preset, seed=args.seed)
    if args.task not in WARM_STARTED or args.warm_start_steps == 0 or args.prompts:
        return base
    from services.demo_tasks.warm_start import warm_start

    task = DEMO_TASKS[args.task]
    rows = [task.generate(i) for i in range(4000)]
    out = os.path.join(workdir, "warm")
    result = warm_start(
        base,
        out,
        rows,
        args.warm_start_steps,
        32,
        5e-4,
        args.seed,
        args.warm_start_target,
        rows[:64],
        max_new_tokens=args.max_new_tokens,
    )
    print(json.dumps({"event": "warm_start", "model": out, **result}), file=sys.stderr, flush=True)
    return out


def list_tasks() -> int:
    for name, task in DEMO_TASKS.items():
        print(f"{name:10s} {task.summary} (reward: {task.reward})")
    return 0


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The task and the run config's shape: steps, mode, estimator, prompts, batch and sampling."""
    parser.add_argument(
        "--task",
        nargs="?",
        const="",
        default="reverse",
        help="the built-in task (demo:<task>); --task alone lists them",
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument(
        "--mode",
        choices=["fully_async", "colocate"],
        default="fully_async",
        help="fully_async (overlapped) or colocate (synchronous, max_staleness 0)",
    )
    parser.add_argument("--max-staleness", type=int, default=1, help="versions rollout may run ahead (fully_async)")
    parser.add_argument("--estimator", default="grpo", choices=ESTIMATORS, help="advantage estimator")
    parser.add_argument(
        "--prompts", default="", help="a .jsonl or .parquet file instead of the task's prompts (no warm start, no eval)"
    )
    parser.add_argument("--groups-per-step", type=int, default=8, help="prompt groups per step")
    parser.add_argument("--n-samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="most tokens per sample (and per eval answer)")
    parser.add_argument("--temperature", type=float, default=0.7, help="the rollout's sampling temperature")
    parser.add_argument(
        "--filter-groups",
        default="",
        help="dynamic sampling (run config rollout.filter_groups): none, zero_variance or "
        "std_below:X; default: the task's (zero_variance for reverse, none for the others); "
        "a model that never answers right has every group dropped and fails the run",
    )


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """The actor's optimizer (learning rate and its schedule) and the seed of the model, warm start and run."""
    parser.add_argument("--lr", type=float, default=1e-4, help="actor learning rate (AdamW)")
    parser.add_argument(
        "--lr-schedule",
        default="cosine",
        choices=["constant", "linear", "cosine"],
        help="the learning rate over the steps (run config optim.lr_schedule)",
    )
    parser.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="where linear and cosine decay end, as a fraction of --lr"
    )
    parser.add_argument("--seed", type=int, default=0, help="model, warm start, prompt order and trainer seed")


def add_eval_and_warm_start_flags(parser: argparse.ArgumentParser) -> None:
    """Held-out evaluation during the run, and the supervised warm start before it."""
    parser.add_argument("--eval-every", type=int, default=5, help="held-out eval every N versions; 0 = none")
    parser.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts per eval")
    parser.add_argument("--warm-start-steps", type=int, default=300, help="most warm-start steps; 0 = none")
    parser.add_argument(
        "--warm-start-target",
        type=float,
        default=0.25,
        help="the warm start stops once its greedy score on 64 training prompts reaches this",
    )


def add_stack_flags(parser: argparse.ArgumentParser) -> None:
    """The services on this machine: engines, the model, where files go, checkpoints, the view."""
    parser.add_argument("--engines", type=int, default=1, help="built-in engine processes")
    parser.add_argument("--model", default="", help="a local HF model directory; default: a new random model")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"], help="size of the random model")
    parser.add_argument("--workdir", default="", help="where model, logs and checkpoints go (default: a temp dir)")
    parser.add_argument(
        "--checkpoint-interval", type=int, default=0, help="checkpoint every N steps; 0 = only when the trainer stops"
    )
    parser.add_argument(
        "--coordinator-port",
        type=int,
        default=0,
        help="the coordinator's port (for `sluice status demo` elsewhere); 0 = any free port",
    )
    parser.add_argument(
        "--view",
        choices=["auto", "live", "json"],
        default="auto",
        help="live panel, JSON lines, or auto: the panel when stdout is a terminal",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice demo", description=__doc__, formatter_class=HelpWithDefaults)
    add_run_flags(parser)
    add_optimizer_flags(parser)
    add_eval_and_warm_start_flags(parser)
    add_stack_flags(parser)
    args = parser.parse_args(argv)
    if args.task and args.task not in DEMO_TASKS:
        parser.error(f"--task: unknown task {args.task!r}; one of {', '.join(DEMO_TASKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.task:
        return list_tasks()
    workdir = args.workdir or tempfile.mkdtemp(prefix="sluice-demo-")
    os.makedirs(workdir, exist_ok=True)
    model_dir = prepare_model(args, workdir)
    options = RunOptions(view=args.view, check=exactly_once)
    try:
        return start_and_follow(build_run(args, model_dir, workdir), options)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
