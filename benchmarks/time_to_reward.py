"""Time to reward: the same GRPO, same task, model, warm start and hyper-parameters, run three ways on this
machine's CPU cores, each the strongest way a user would run it: TRL's GRPOTrainer on every core, a plain
in-process GRPO loop (one process) and the whole Sluice stack (every service its own process). Two task
shapes (--tasks). Prints ONE JSON object on stdout; progress goes to stderr.

Tasks (benchmarks/ttr_tasks.py; each its own random Qwen2 model `init_model(preset, seed=--seed)`, rows,
reward and defaults):
  reverse  reverse 3-5 letters, exact_match reward (binary), the "small" preset (~3.4M parameters), 80 steps,
           12 new tokens: training-bound.
  short    reverse 2-4 letters, a partial-credit reward (the fraction of answer positions right), the "mini"
           preset (~0.28M parameters), answers of 2-4 tokens, 300 steps: each step's compute is small, so its
           fixed cost dominates.
Prompts go through the chat template exactly as the rollout role encodes them (TRL gets the same chat messages
and its tokenization is checked to give the same ids). Every system starts from the same short supervised warm
start (benchmarks/warm_start.py; stopped once the task's greedy score on training prompts reaches --sft-target,
at most --sft-steps steps).

The runs: GRPO (group-normalised advantages), no KL, clip 0.2, token-mean loss over the global batch,
constant learning rate (--lr), AdamW (betas 0.9/0.999, no weight decay), gradient clip 1.0, --n-samples
samples per prompt, --groups prompts per step, one optimizer step per step (micro batches of
--micro-batch-size), sampling at --temperature, --max-new-tokens, --seed; --steps steps each.
  trl        benchmarks/trl_grpo.py: trl.GRPOTrainer on CPU, float32, generation every step (on-policy), in its
             own process whose OpenMP/MKL and torch intra-op threads are --trl-threads (default: every core,
             os.cpu_count()). Skipped, with a note in the JSON, when trl is not installed.
  inprocess  benchmarks/inprocess_grpo.py: generate, score, GRPO advantages (services/algorithms) and one
             `actor_step` (the Sluice trainer's loss code) per step, synchronous and on-policy, prompts in
             the rollout role's order; one run per --inprocess-threads count (default 1, 2 and every core:
             torch intra-op threads, OpenMP's and MKL's with them). Generators (--inprocess-generator, default
             engine): `hf` (transformers generate) and `engine` (the built-in engine's scheduler as a library,
             weights copied in after every optimizer step). Each run is its own block (inprocess_engine_2t).
  sluice     benchmarks/ttr_sluice.py: redis, TransferQueue, coordinator, one built-in engine, rollout,
             advantage and trainer processes, one torch thread each (as `sluice run` starts them; together
             they use every core); --mode fully_async (max_staleness --max-staleness, default 1) or colocate;
             --off-policy plain | decoupled | decoupled-uncapped | tis:X (the staleness study).
This process keeps one torch thread (the warm start and scoring, untimed) and waits while a system runs.
Every system's block says its threads (`torch_threads`; sluice's `threads`).

Timing: the clock starts at the first training step: TRL's first on_step_begin; the in-process loop's
first generation; Sluice's rollout is started last, after every other role is ready, and the clock starts
when it reports ready. Model writing, warm start, construction and the Sluice stack's start-up are excluded
and reported as startup_s. A step's time is when its optimizer step is done (TRL: the step-end callback;
in-process: after the optimizer step and engine weight copy; Sluice: the trainer's progress record, polled
every --poll-ms).

Evaluation: every --eval-every steps every system writes a checkpoint with the same function (save_checkpoint:
model + optimizer), inside the timed window. After each run this process scores every checkpoint greedily on
the same held-out prompts with the task's reward and deletes them. time_to_reward_s[t] is the time of the
first evaluated step whose score is >= t (null if never reached). Per task, each ratio is sluice's time over
a baseline's at the highest threshold both reach after step 0 (target <= 1.0): ratio_vs_trl,
ratio_vs_inprocess (the in-process run least favourable to Sluice) and ratio_vs_strongest (over every
baseline); the top-level `ratios` repeats them.

Repetitions: --reps r (default 3; 1 with --quick) runs each system once per RL seed --seed, --seed+1, ...
(the same seed for all in a rep; one warm start per task, from --seed), the order of the systems reversed
every other rep. Figures are medians over reps (a threshold a rep never reaches counts as infinitely late);
the curve shown is the first rep's.

Usage (TRL comes from `pip install -e .[bench]`, installed after the pinned CPU torch):
    python benchmarks/time_to_reward.py --quick                 # smoke: both tasks, one rep, few steps
    python benchmarks/time_to_reward.py --tasks short --quick   # the short task's smoke
    python benchmarks/time_to_reward.py [--tasks reverse,short] [--reps 3] [--steps N] [--mode fully_async]
                                        [--systems trl,sluice,inprocess] [--trl-threads N]
                                        [--inprocess-threads 1,2] [--seed 0] [--thresholds 0.6,0.7,0.8,0.9]
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmark modules
from warm_start import greedy_eval, warm_start  # noqa: E402
from inprocess_grpo import run_inprocess  # noqa: E402
from trl_grpo import TrlSpec, run_trl  # noqa: E402
from ttr_args import parse_args, task_args  # noqa: E402
from ttr_sluice import run_sluice, sluice_config  # noqa: E402
from ttr_summary import median_result, ratio, ratio_vs_strongest, system_result  # noqa: E402
from ttr_tasks import TASKS, make_splits  # noqa: E402

from services.model.init_model import init_model  # noqa: E402

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through LocalRun.__exit__, which stops every process


def prepare(args, workdir: str) -> dict:
    """The task's random model, rows (train JSONL for Sluice and TRL), warm start, and its held-out score."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = TASKS[args.task]
    started = time.monotonic()
    base = init_model(os.path.join(workdir, "base"), preset=args.preset, arch="qwen2", seed=args.seed)
    train_rows, eval_rows = make_splits(args.task, args.seed, args.n_train, args.n_eval)
    prompts_path = os.path.join(workdir, "train.jsonl")
    with open(prompts_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train_rows)
    warm_dir = os.path.join(workdir, "warm")
    sft = warm_start(
        base,
        warm_dir,
        train_rows,
        args.sft_steps,
        args.sft_batch_size,
        args.sft_lr,
        args.seed,
        args.sft_target,
        train_rows[:64],
        shape.score,
        max_new_tokens=args.max_new_tokens,
    )
    tokenizer = AutoTokenizer.from_pretrained(warm_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(warm_dir, local_files_only=True, dtype=torch.float32)
    sft["eval_reward"] = greedy_eval(model, tokenizer, eval_rows, args.max_new_tokens, shape.score)
    sft["params"] = sum(p.numel() for p in model.parameters())
    sft["setup_s"] = round(time.monotonic() - started, 2)
    log(f"{args.task}: warm start {sft}")
    return {
        "warm_dir": warm_dir,
        "eval_rows": eval_rows,
        "prompts_path": prompts_path,
        "tokenizer": tokenizer,
        "sft": sft,
    }


def trl_spec(args, prep: dict, workdir: str) -> TrlSpec:
    return TrlSpec(
        task=args.task,
        warm_dir=prep["warm_dir"],
        prompts_path=prep["prompts_path"],
        workdir=workdir,
        threads=args.trl_threads,
        steps=args.steps,
        groups=args.groups,
        n_samples=args.n_samples,
        micro_batch_size=args.micro_batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        lr=args.lr,
        eval_every=args.eval_every,
        seed=args.seed,
    )


def run_system(args, system: str, prep: dict, workdir: str) -> dict:
    score = TASKS[args.task].score
    if system == "trl":
        return run_trl(trl_spec(args, prep, workdir), prep["eval_rows"], prep["tokenizer"], score, log)
    if system.startswith("inprocess_"):  # synchronous and on-policy: Sluice's RunConfig in colocate mode
        colocate = argparse.Namespace(**{**vars(args), "mode": "colocate", "off_policy": "plain"})
        run = sluice_config(colocate, prep["warm_dir"], prep["prompts_path"])
        generator, threads = system.removeprefix("inprocess_").split("_")
        return run_inprocess(
            run, generator, int(threads.removesuffix("t")), prep["eval_rows"], workdir, prep["tokenizer"], log, score
        )
    return run_sluice(args, prep["warm_dir"], prep["prompts_path"], prep["eval_rows"], workdir, prep["tokenizer"], log)


def one_rep(args, system: str, prep: dict, workdir: str) -> dict:
    log(f"{args.task}/{system}: starting ({args.steps} steps, seed {args.seed})")
    raw = run_system(args, system, prep, workdir)
    for scored in ("checkpoints", "snapshots"):  # scored by now; logs stay
        shutil.rmtree(os.path.join(workdir, scored), ignore_errors=True)
    keep = ("max_staleness_seen", "generator", "torch_threads", "threads", "env_threads", "per_step", "on_policy")
    result = system_result(
        {0: 0.0, **raw["step_end"]},
        raw["train_reward"],
        {0: prep["sft"]["eval_reward"], **raw["eval_reward"]},
        raw["startup_s"],
        args.thresholds,
        seed=args.seed,
        **{k: raw[k] for k in keep if k in raw},
    )
    log(
        f"{args.task}/{system}: {result['time_to_reward_s']} (steps/s {result['steps_per_s']}, "
        f"final eval {result['final_eval_reward']})"
    )
    return result


def systems_to_run(args, notes: list[str]) -> list[str]:
    """--systems with `inprocess` expanded into its generators and thread counts (inprocess_engine_2t, ...);
    trl dropped (noted) when not installed."""
    out = []
    for system in args.systems:
        if system == "trl" and importlib.util.find_spec("trl") is None:
            notes.append("trl skipped: not installed (pip install -e .[bench])")
            log(notes[-1])
            continue
        if system == "inprocess":
            gens = ("hf", "engine") if args.inprocess_generator == "both" else (args.inprocess_generator,)
            out += [f"inprocess_{g}_{t}t" for g in gens for t in args.inprocess_threads]
        else:
            out.append(system)
    return out


def task_ratios(summary: dict[str, dict], thresholds: list[float]) -> dict:
    baselines = {s: b for s, b in summary.items() if s != "sluice"}
    return {
        "ratio_vs_trl": ratio(summary.get("trl"), summary.get("sluice"), thresholds),
        "ratio_vs_inprocess": ratio_vs_strongest(
            {s: b for s, b in baselines.items() if s.startswith("inprocess_")}, summary.get("sluice"), thresholds
        ),
        "ratio_vs_strongest": ratio_vs_strongest(baselines, summary.get("sluice"), thresholds),
    }


def run_task(args, systems: list[str], workdir: str) -> dict:
    """One task: its warm start, every system once per rep, medians, the ratios."""
    prep = prepare(args, workdir)
    results: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(args.reps):  # every system is deterministic for a seed: each rep is its own RL seed
        rep_args = argparse.Namespace(**{**vars(args), "seed": args.seed + rep})
        for system in systems if rep % 2 == 0 else systems[::-1]:
            results[system].append(one_rep(rep_args, system, prep, os.path.join(workdir, f"rep{rep}-{system}")))
    summary = {s: median_result(results[s]) for s in results}
    shape = TASKS[args.task]
    config = {
        "summary": shape.summary,
        "reward": shape.reward_spec,
        "params": prep["sft"]["params"],
        **{
            k: getattr(args, k)
            for k in (
                "preset",
                "steps",
                "eval_every",
                "thresholds",
                "max_new_tokens",
                "lr",
                "n_train",
                "n_eval",
                "sft_target",
                "sft_steps",
                "sft_lr",
            )
        },
    }
    threads = {s: summary[s].get("torch_threads") for s in summary}
    return {
        "config": config,
        "warm_start": prep["sft"],
        "torch_threads": threads,
        **summary,
        **task_ratios(summary, args.thresholds),
    }


def versions() -> dict:
    out = {}
    for name in ("torch", "transformers", "trl"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def run_benchmark(args) -> dict:
    notes: list[str] = []
    systems = systems_to_run(args, notes)
    workdir = args.workdir or tempfile.mkdtemp(prefix="sluice-ttr-")
    tasks = {task: run_task(task_args(args, task), systems, os.path.join(workdir, task)) for task in args.tasks}
    shared = {k: v for k, v in vars(args).items() if k not in tasks[args.tasks[0]]["config"]}
    return {
        "benchmark": "time_to_reward",
        "config": {
            **shared,
            "arch": "qwen2",
            "rows_per_step": args.groups * args.n_samples,
            "max_staleness": 0 if args.mode == "colocate" else args.max_staleness,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            **versions(),
            "workdir": workdir,
        },
        "notes": notes,
        "tasks": tasks,
        "ratios": {
            task: {k: block[k] for k in ("ratio_vs_trl", "ratio_vs_inprocess", "ratio_vs_strongest")}
            for task, block in tasks.items()
        },
        "runtime_s": round(time.perf_counter() - _T0, 1),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    torch.set_num_threads(1)  # this process: the warm start and scoring (untimed); each system sets its own
    stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):  # libraries print: keep stdout for the JSON
            result = run_benchmark(args)
    except KeyboardInterrupt:
        log("interrupted; every started process was stopped")
        return 130
    print(json.dumps(result, indent=2), file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
