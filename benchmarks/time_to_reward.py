"""Time to reward: three ways to run the same GRPO, same task, model, warm start and hyper-parameters, on
this machine's CPU cores: TRL's GRPOTrainer (one process), a plain in-process GRPO loop (one process, the
strongest way a user would run it without Sluice; the baseline) and the whole Sluice stack (every service
its own process). Prints ONE JSON object on stdout; progress goes to stderr.

Setup (not timed, reported separately): a random Qwen2 model (`init_model(preset=--preset, seed=--seed)`,
~3.4M parameters for "small"), the task of benchmarks/warm_start.py (reverse 3-5 letters, exact_match
reward, prompts through the chat template exactly as the rollout role encodes them; TRL gets the same
chat messages and its tokenization is checked to give the same ids), and a short supervised warm start
that every system starts from (stopped once its greedy score on training prompts reaches --sft-target,
at most --sft-steps steps; ~60 steps, held-out score ~0.48 at the defaults).

The runs: GRPO (group-normalised advantages), no KL, clip 0.2, token-mean loss over the global batch,
constant learning rate (--lr), AdamW (betas 0.9/0.999, no weight decay), gradient clip 1.0, --n-samples
samples per prompt, --groups prompts per step, one optimizer step per step (micro batches of
--micro-batch-size), sampling at --temperature, --max-new-tokens, --seed; --steps steps each.
  trl        trl.GRPOTrainer on CPU, float32, no gradient checkpointing, generation every step (on-policy).
             Skipped, with a note in the JSON, when trl is not installed.
  inprocess  benchmarks/inprocess_grpo.py: generate, score, GRPO advantages (services/algorithms) and one
             `actor_step` (the Sluice trainer's loss code) per step, synchronous and on-policy, prompts in
             the rollout role's order; one run per --inprocess-threads count (default 1,2: one core, and
             both cores through torch's intra-op threads, which halve its training step here). Generators
             (--inprocess-generator, default engine): `hf` (transformers generate of the trained model, one
             batch a step, ~4x slower here) and `engine` (the built-in engine's scheduler as a library,
             weights copied in after every optimizer step). Each run is its own block (inprocess_engine_2t);
             the baseline is the one fastest to reward.
  sluice     services/launch/local_run.py: redis, TransferQueue, coordinator, one built-in engine, rollout,
             advantage and trainer processes, one torch thread each; --mode fully_async (max_staleness
             --max-staleness, default 1) or colocate (synchronous, max_staleness 0).

Timing: the clock starts at the first training step: TRL's first on_step_begin; the in-process loop's
first generation; Sluice's rollout is started last, after every other role is ready, and the clock starts
when it reports ready (its generation loop begins). Model writing, warm start, construction and the Sluice
stack's start-up are excluded and reported as startup_s. A step's time is when its optimizer step is done
(TRL: the step-end callback; in-process: after the step's optimizer step and engine weight copy; Sluice:
the trainer's progress record, polled every --poll-ms).

Evaluation: every --eval-every steps every system writes a checkpoint with the same function
(services/run_contract/checkpoint.py save_checkpoint: model + optimizer; the Sluice trainer does it itself via
RunConfig.checkpoint_interval, the TRL run from a step-end callback, the in-process loop after the step),
so all pay the same cost inside the timed window. After each run, this process scores every checkpoint
greedily on the same held-out prompts (warm_start.greedy_eval: the HF model, mean exact_match) and deletes
them (benchmarks/ttr_summary.py). time_to_reward_s[t] is the time of the first evaluated step whose score
is >= t (null if never reached; steps_to_reward: that step); each ratio is sluice's time over a baseline's
(trl; the faster in-process generator) for the highest threshold both reach after step 0 (target <= 1.0).

Repetitions: --reps r runs each system once per RL seed --seed, --seed+1, ... (the same seed for all in a
rep; one warm start, from --seed), the order of the systems reversed every other rep. For one seed every
system trains the same way every time on CPU, so only a new seed shows the spread of the learning curve.
Figures are medians over reps (a threshold a rep never reaches counts as infinitely late); the curve
shown is the first rep's. The default is 1 rep: one rep of trl and sluice takes ~2.5 minutes on 2 idle cores.

Usage (TRL comes from `pip install -e .[bench]`, installed after the pinned CPU torch):
    python benchmarks/time_to_reward.py --quick          # smoke: 20 steps
    python benchmarks/time_to_reward.py [--steps 80] [--reps 1] [--mode fully_async|colocate]
                                        [--systems trl,sluice,inprocess] [--inprocess-generator both|hf|engine]
                                        [--inprocess-threads 1,2] [--seed 0] [--thresholds 0.6,0.7,0.8,0.9]
"""

from __future__ import annotations

import os

# one torch/BLAS thread, set before torch loads (children inherit it as well)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmark modules
from warm_start import greedy_eval, make_splits, warm_start  # noqa: E402
from inprocess_grpo import run_inprocess  # noqa: E402
from trl_grpo import run_trl  # noqa: E402
from ttr_summary import evaluate, median_result, ratio, ratio_vs_strongest, system_result  # noqa: E402

from services.run_contract.run_config import RunConfig  # noqa: E402
from services.launch.local_run import LocalRun  # noqa: E402
from services.model.init_model import init_model  # noqa: E402
from services.run_state.trainer_progress import read_progress, trained_steps  # noqa: E402
from services.runtime.processes import http_ok  # noqa: E402
from services.run_contract.checkpoint import checkpoints  # noqa: E402

RUN_ID = "bench-time-to-reward"
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through LocalRun.__exit__, which stops every process


# ---------------------------------------------------------------------------------- Sluice


class TimedRun(LocalRun):
    """LocalRun whose rollout starts last, once every other role is ready: the rollout reporting ready
    (its generation loop begins) is the start of training, `rollout_ready_at`."""

    rollout_ready_at: float | None = None
    _hold_rollout = False

    def _start_roles(self) -> None:
        self._hold_rollout = True
        super()._start_roles()
        self._hold_rollout = False
        for name, proc in self.procs.items():
            if not name.startswith("engine"):
                proc.wait_until(lambda p=proc: http_ok(p.status_url + "/readyz"), 300)
        rollout = self.start_role("rollout")
        rollout.wait_until(lambda: http_ok(rollout.status_url + "/readyz"), 300)
        self.rollout_ready_at = time.monotonic()

    def start_role(self, name: str):
        if name == "rollout" and self._hold_rollout:
            return None
        return super().start_role(name)


def sluice_config(args, warm_dir: str, prompts_path: str) -> RunConfig:
    rows = args.groups * args.n_samples
    return RunConfig(name=RUN_ID, model=warm_dir, mode=args.mode,
                     max_staleness=0 if args.mode == "colocate" else args.max_staleness,
                     n_samples_per_prompt=args.n_samples, rollout_batch_size=args.groups, global_batch_size=rows,
                     micro_batch_size=args.micro_batch_size, num_steps=args.steps,
                     checkpoint_interval=args.eval_every,
                     algorithm={"estimator": "grpo", "kl_coef": 0.0, "eps_clip": 0.2, "loss_agg": "token_mean"},
                     rollout={"prompts": prompts_path, "reward": "exact_match", "label_field": "label",
                              "apply_chat_template": True, "shuffle_seed": args.seed,
                              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
                     optim={"lr": args.lr, "weight_decay": 0.0, "grad_clip": 1.0, "seed": args.seed})


def capture(ckpt_dir: str, snap_dir: str, snaps: dict[int, str]) -> None:
    """Hard-link each new complete trainer checkpoint (the trainer keeps only the last two)."""
    for c in checkpoints(ckpt_dir, "actor"):
        if c.next_step in snaps:
            continue
        dst = os.path.join(snap_dir, f"step_{c.next_step:08d}")
        try:
            os.makedirs(dst, exist_ok=True)
            for name in os.listdir(c.path):
                os.link(os.path.join(c.path, name), os.path.join(dst, name))
            snaps[c.next_step] = dst
        except OSError as exc:  # deleted meanwhile: retried from the next listing if it still exists
            log(f"sluice: could not capture {c.path}: {exc}")


def run_sluice(args, warm_dir: str, prompts_path: str, eval_rows: list[dict], workdir: str, tokenizer) -> dict:
    run = sluice_config(args, warm_dir, prompts_path)
    ckpt_dir, snap_dir = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "snapshots")
    started = time.monotonic()
    step_end: dict[int, float] = {}
    snaps: dict[int, str] = {}
    with TimedRun(run, log_dir=os.path.join(workdir, "logs"), checkpoint_dir=ckpt_dir) as local:
        t0 = local.rollout_ready_at
        log(f"sluice: stack ready after {t0 - started:.1f}s ({', '.join(sorted(local.procs))})")
        with local.redis_client() as r:
            while len(step_end) < run.num_steps:
                if time.monotonic() - t0 > args.timeout_s:
                    raise TimeoutError(f"sluice: {len(step_end)} of {run.num_steps} steps after {args.timeout_s}s; "
                                       f"logs in {local.log_dir}")
                next_step = read_progress(r, run.name).next_step
                now = time.monotonic() - t0
                for s in range(len(step_end) + 1, next_step + 1):
                    step_end[s] = now  # steps counted from 1, as TRL's global_step
                capture(ckpt_dir, snap_dir, snaps)
                if next_step < run.num_steps:
                    local.check_alive()
                    time.sleep(args.poll_ms / 1e3)
            capture(ckpt_dir, snap_dir, snaps)
            done = trained_steps(r, run.name)
    train_reward = {s + 1: float(rec["metrics"]["reward_mean"]) for s, rec in done.items()}
    staleness = max(int(k) for rec in done.values() for k in rec["metrics"]["staleness"])
    log(f"sluice: {run.num_steps} steps in {max(step_end.values()):.1f}s; evaluating {len(snaps)} checkpoints")
    evals = evaluate(snaps, tokenizer, eval_rows, args.max_new_tokens)
    return {"step_end": step_end, "train_reward": train_reward, "eval_reward": evals, "startup_s": t0 - started,
            "max_staleness_seen": staleness}


# ---------------------------------------------------------------------------------- main


def prepare(args, workdir: str) -> dict:
    """Random model, task rows (train JSONL for Sluice), warm start, and the warm model's held-out score."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    base = init_model(os.path.join(workdir, "base"), preset=args.preset, arch="qwen2", seed=args.seed)
    train_rows, eval_rows = make_splits(args.seed, args.n_train, args.n_eval)
    prompts_path = os.path.join(workdir, "train.jsonl")
    with open(prompts_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train_rows)
    warm_dir = os.path.join(workdir, "warm")
    sft = warm_start(base, warm_dir, train_rows, args.sft_steps, args.sft_batch_size, args.sft_lr, args.seed,
                     args.sft_target, train_rows[:64], max_new_tokens=args.max_new_tokens)
    tokenizer = AutoTokenizer.from_pretrained(warm_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(warm_dir, local_files_only=True, dtype=torch.float32)
    sft["eval_reward"] = greedy_eval(model, tokenizer, eval_rows, args.max_new_tokens)
    sft["params"] = sum(p.numel() for p in model.parameters())
    sft["setup_s"] = round(time.monotonic() - started, 2)
    log(f"warm start: {sft}")
    return {"warm_dir": warm_dir, "train_rows": train_rows, "eval_rows": eval_rows, "prompts_path": prompts_path,
            "tokenizer": tokenizer, "sft": sft}


def one_rep(args, system: str, prep: dict, workdir: str) -> dict:
    log(f"{system}: starting ({args.steps} steps, seed {args.seed})")
    if system == "trl":
        raw = run_trl(args, prep["warm_dir"], prep["train_rows"], prep["eval_rows"], workdir, prep["tokenizer"], log)
    elif system.startswith("inprocess_"):  # synchronous and on-policy: Sluice's RunConfig in colocate mode
        run = sluice_config(argparse.Namespace(**{**vars(args), "mode": "colocate"}), prep["warm_dir"],
                            prep["prompts_path"])
        generator, threads = system.removeprefix("inprocess_").split("_")
        raw = run_inprocess(run, generator, int(threads.removesuffix("t")), prep["eval_rows"], workdir,
                            prep["tokenizer"], log)
    else:
        raw = run_sluice(args, prep["warm_dir"], prep["prompts_path"], prep["eval_rows"], workdir, prep["tokenizer"])
    for scored in ("checkpoints", "snapshots"):  # ~40 MB per checkpoint, all scored by now; logs stay
        shutil.rmtree(os.path.join(workdir, scored), ignore_errors=True)
    keep = ("max_staleness_seen", "generator", "torch_threads", "per_step", "on_policy")
    result = system_result({0: 0.0, **raw["step_end"]}, raw["train_reward"],
                           {0: prep["sft"]["eval_reward"], **raw["eval_reward"]}, raw["startup_s"], args.thresholds,
                           seed=args.seed, **{k: raw[k] for k in keep if k in raw})
    log(f"{system}: {result['time_to_reward_s']} (steps/s {result['steps_per_s']}, "
        f"final eval {result['final_eval_reward']})")
    return result


def systems_to_run(args, notes: list[str]) -> list[str]:
    """--systems with `inprocess` expanded into its generators and thread counts (inprocess_engine_2t, ...);
    trl dropped (noted) when not installed."""
    out = []
    for system in args.systems:
        if system == "trl":
            try:
                import trl  # noqa: F401
            except ImportError:
                notes.append("trl skipped: not installed (pip install -e .[bench])")
                log(notes[-1])
                continue
        if system == "inprocess":
            gens = ("hf", "engine") if args.inprocess_generator == "both" else (args.inprocess_generator,)
            out += [f"inprocess_{g}_{t}t" for g in gens for t in args.inprocess_threads]
        else:
            out.append(system)
    return out


def run_benchmark(args) -> dict:
    import transformers

    notes: list[str] = []
    systems = systems_to_run(args, notes)
    workdir = args.workdir or tempfile.mkdtemp(prefix="sluice-ttr-")
    prep = prepare(args, workdir)
    results: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(args.reps):  # every system is deterministic for a seed: each rep is its own RL seed
        rep_args = argparse.Namespace(**{**vars(args), "seed": args.seed + rep})
        for system in (systems if rep % 2 == 0 else systems[::-1]):
            results[system].append(one_rep(rep_args, system, prep, os.path.join(workdir, f"rep{rep}-{system}")))
    summary = {s: median_result(results[s]) for s in results}
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if "trl" in summary:
        import trl
        versions["trl"] = trl.__version__
    return {
        "benchmark": "time_to_reward",
        "config": {"task": "reverse 3-5 letters (benchmarks/warm_start.py), exact_match reward", "arch": "qwen2",
                   "params": prep["sft"]["params"], "rows_per_step": args.groups * args.n_samples,
                   **vars(args), "max_staleness": 0 if args.mode == "colocate" else args.max_staleness,
                   "cpus": os.cpu_count(), "python": platform.python_version(), **versions, "workdir": workdir},
        "notes": notes,
        "warm_start": prep["sft"],
        **summary,
        "ratio": ratio(summary.get("trl"), summary.get("sluice"), args.thresholds),
        "ratio_vs_inprocess": ratio_vs_strongest({s: b for s, b in summary.items() if s.startswith("inprocess_")},
                                                 summary.get("sluice"), args.thresholds),
        "runtime_s": round(time.perf_counter() - _T0, 1),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80, help="RL steps per run (default 80)")
    p.add_argument("--reps", type=int, default=1, help="fresh runs per system; medians over them (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke setting: 20 steps (same warm start)")
    p.add_argument("--systems", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=["trl", "sluice", "inprocess"], help="comma-separated: trl, sluice, inprocess (default all)")
    p.add_argument("--inprocess-generator", choices=["both", "hf", "engine"], default="engine",
                   help="the in-process loop's generator: transformers generate, the built-in engine, or both runs")
    p.add_argument("--inprocess-threads", type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   default=[1, 2], help="torch threads of the in-process loop, a run per count (default 1,2)")
    p.add_argument("--mode", choices=["fully_async", "colocate"], default="fully_async", help="Sluice's mode")
    p.add_argument("--max-staleness", type=int, default=1, help="fully_async's staleness bound (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--thresholds", type=lambda s: [float(x) for x in s.split(",")], default=[0.6, 0.7, 0.8, 0.9],
                   help="held-out greedy rewards to time (default 0.6,0.7,0.8,0.9; the warm start scores ~0.45)")
    p.add_argument("--eval-every", type=int, default=5, help="checkpoint + held-out eval every K steps")
    p.add_argument("--n-samples", type=int, default=8, help="group size (default 8)")
    p.add_argument("--groups", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--sft-steps", type=int, default=300, help="most warm-start steps (default 300)")
    p.add_argument("--sft-target", type=float, default=0.4,
                   help="warm start stops at this greedy score on 64 training prompts (default 0.4)")
    p.add_argument("--sft-batch-size", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=5e-4)
    p.add_argument("--n-train", type=int, default=4000, help="training prompts")
    p.add_argument("--n-eval", type=int, default=128, help="held-out prompts")
    p.add_argument("--workdir", default="", help="model, checkpoints and logs (default: a new temp dir)")
    p.add_argument("--poll-ms", type=float, default=20.0)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per Sluice run, after start-up")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 20
    rows = args.groups * args.n_samples
    unknown = set(args.systems) - {"trl", "sluice", "inprocess"}
    if unknown or not args.systems:
        p.error(f"--systems: unknown {sorted(unknown)} (trl, sluice, inprocess)")
    if rows % args.micro_batch_size:
        p.error("--groups x --n-samples must be a multiple of --micro-batch-size")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):  # libraries print (TRL's log lines): keep stdout for the JSON
            result = run_benchmark(args)
    except KeyboardInterrupt:
        log("interrupted; every started process was stopped")
        return 130
    print(json.dumps(result, indent=2), file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
