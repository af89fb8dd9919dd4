"""Time to reward: TRL's GRPOTrainer (one process) vs the whole Sluice stack (every service its own
process), same task, model, warm start and hyper-parameters, on this machine's CPU cores. Prints ONE
JSON object on stdout; progress goes to stderr.

Setup (not timed, reported separately): a random Qwen2 model (`init_model(preset=--preset, seed=--seed)`,
~3.4M parameters for "small"), the task of benchmarks/warm_start.py (reverse 3-5 letters, exact_match
reward, prompts through the chat template exactly as the rollout role encodes them; TRL gets the same
chat messages and its tokenization is checked to give the same ids), and a short supervised warm start
that both systems start from (stopped once its greedy score on training prompts reaches --sft-target,
at most --sft-steps steps; ~60 steps, held-out score ~0.48 at the defaults).

The runs: GRPO (group-normalised advantages), no KL, clip 0.2, token-mean loss over the global batch,
constant learning rate (--lr), AdamW (betas 0.9/0.999, no weight decay), gradient clip 1.0, --n-samples
samples per prompt, --groups prompts per step, one optimizer step per step (micro batches of
--micro-batch-size), sampling at --temperature, --max-new-tokens, --seed; --steps steps each.
  trl     trl.GRPOTrainer on CPU, float32, no gradient checkpointing, generation every step (on-policy).
  sluice  services/launch/local_run.py: redis, TransferQueue, coordinator, one built-in engine, rollout,
          advantage and trainer processes, one torch thread each; --mode fully_async (max_staleness
          --max-staleness, default 1) or colocate (synchronous, max_staleness 0).

Timing: the clock starts at the first training step: TRL's first on_step_begin; Sluice's rollout is
started last, after every other role is ready, and the clock starts when it reports ready (its
generation loop begins). Model writing, warm start, TRL construction and the Sluice stack's start-up are
excluded and reported as startup_s. A step's time is when its optimizer step is done (TRL: the
step-end callback; Sluice: the trainer's progress record, polled every --poll-ms).

Evaluation: every --eval-every steps both systems write a checkpoint with the same function
(services/run_contract/checkpoint.py save_checkpoint: model + optimizer; the Sluice trainer does it itself via
RunConfig.checkpoint_interval, the TRL run from a step-end callback), so both pay the same cost inside
the timed window. After each run, this process scores every checkpoint greedily on the same held-out
prompts (warm_start.greedy_eval: the HF model, mean exact_match) and deletes them. time_to_reward_s[t] is the time of
the first evaluated step whose score is >= t (null if never reached; steps_to_reward: that step);
the ratio is sluice / trl for the highest threshold both reach after step 0 (target <= 1.0).

Repetitions: --reps r runs each system once per RL seed --seed, --seed+1, ... (the same seed for both
in a rep; one warm start, from --seed), alternating which system goes first. For one seed both systems
train the same way every time on CPU, so only a new seed shows the spread of the learning curve.
Figures are medians over reps (a threshold a rep never reaches counts as infinitely late); the curve
shown is the first rep's. The default is 1 rep: one rep of both takes ~2.5 minutes on 2 idle cores.

Usage (TRL comes from `pip install -e .[bench]`, installed after the pinned CPU torch):
    python benchmarks/time_to_reward.py --quick          # smoke: 20 steps, ~1.5 minutes
    python benchmarks/time_to_reward.py [--steps 80] [--reps 1] [--mode fully_async|colocate]
                                        [--seed 0] [--thresholds 0.6,0.7,0.8,0.9]
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
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling warm_start module
from warm_start import chat_messages, greedy_eval, make_splits, warm_start  # noqa: E402
from services.demo_tasks.warm_start import encode_prompt  # noqa: E402

from services.run_contract.run_config import RunConfig  # noqa: E402
from services.launch.local_run import LocalRun  # noqa: E402
from services.model.init_model import init_model  # noqa: E402
from services.rollout.rewards.builtin import exact_match  # noqa: E402
from services.run_state.trainer_progress import read_progress, trained_steps  # noqa: E402
from services.runtime.processes import http_ok  # noqa: E402
from services.run_contract.checkpoint import checkpoints, save_checkpoint  # noqa: E402

RUN_ID = "bench-time-to-reward"
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through LocalRun.__exit__, which stops every process


# ---------------------------------------------------------------------------------- evaluation


def evaluate(snapshots: dict[int, str], tokenizer, eval_rows: list[dict], max_new_tokens: int) -> dict[int, float]:
    """step -> greedy held-out reward of the checkpoint written after that step."""
    from transformers import AutoModelForCausalLM

    out = {}
    for step, path in sorted(snapshots.items()):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        out[step] = greedy_eval(model, tokenizer, eval_rows, max_new_tokens)
    return out


def system_result(step_end: dict[int, float], train_reward: dict[int, float], eval_reward: dict[int, float],
                  startup_s: float, thresholds: list[float], **extra) -> dict:
    """step_end and eval_reward include step 0 (the warm start, at 0 s)."""
    steps = max(step_end)
    first = {str(t): next((s for s in sorted(eval_reward) if eval_reward[s] >= t), None) for t in thresholds}
    curve = [{"step": s, "wall_s": round(step_end.get(s, 0.0), 2),
              "train_reward": None if s not in train_reward else round(train_reward[s], 4),
              "eval_reward": None if s not in eval_reward else round(eval_reward[s], 4)}
             for s in range(0, steps + 1)]
    return {"startup_s": round(startup_s, 2), "steps": steps, "wall_s": round(step_end[steps], 2),
            "steps_per_s": round(steps / step_end[steps], 4),
            "time_to_reward_s": {t: None if s is None else round(step_end[s], 2) for t, s in first.items()},
            "steps_to_reward": first, "final_eval_reward": eval_reward[max(eval_reward)], "curve": curve, **extra}


# ---------------------------------------------------------------------------------- TRL


def run_trl(args, warm_dir: str, train_rows: list[dict], eval_rows: list[dict], workdir: str, tokenizer) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ckpt_dir = os.path.join(workdir, "checkpoints")
    rec = {"t0": None, "step_end": {}, "reward": {}}

    class Recorder(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if rec["t0"] is None:
                rec["t0"] = time.monotonic()

        def on_step_end(self, a, state, control, model=None, optimizer=None, **kw):
            step = state.global_step
            if step % args.eval_every == 0:  # as the Sluice trainer's checkpoint_interval
                save_checkpoint(ckpt_dir, "actor", model, optimizer, warm_dir, step, step, keep=1 << 30)
            rec["step_end"][step] = time.monotonic() - rec["t0"]

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rec["reward"][state.global_step] = float(logs["reward"])

    def reward(prompts, completions, label, **kw):
        return [exact_match(c[0]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label)]

    started = time.monotonic()
    rows = args.groups * args.n_samples
    config = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"), per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=rows // args.micro_batch_size, num_generations=args.n_samples,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=args.seed,
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    model = AutoModelForCausalLM.from_pretrained(warm_dir, local_files_only=True, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": chat_messages(r["prompt"]), "label": r["label"]} for r in train_rows])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Recorder()])
    check_same_prompt_ids(trainer, tokenizer, train_rows[0]["prompt"])
    trainer.train()
    startup = rec["t0"] - started
    snaps = {c.next_step: c.path for c in checkpoints(ckpt_dir, "actor")}
    log(f"trl: {args.steps} steps in {max(rec['step_end'].values()):.1f}s; evaluating {len(snaps)} checkpoints")
    evals = evaluate(snaps, tokenizer, eval_rows, args.max_new_tokens)
    return {"step_end": rec["step_end"], "train_reward": rec["reward"], "eval_reward": evals, "startup_s": startup}


def check_same_prompt_ids(trainer, tokenizer, prompt: str) -> None:
    """TRL's tokenization of the chat prompt must give the rollout role's ids."""
    ids, _, _ = trainer._tokenize_prompts([chat_messages(prompt)])
    if [int(t) for t in ids[0]] != encode_prompt(tokenizer, prompt):
        raise RuntimeError("TRL and the Sluice rollout encode the prompt differently")


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
        raw = run_trl(args, prep["warm_dir"], prep["train_rows"], prep["eval_rows"], workdir, prep["tokenizer"])
    else:
        raw = run_sluice(args, prep["warm_dir"], prep["prompts_path"], prep["eval_rows"], workdir, prep["tokenizer"])
    for scored in ("checkpoints", "snapshots"):  # ~40 MB per checkpoint, all scored by now; logs stay
        shutil.rmtree(os.path.join(workdir, scored), ignore_errors=True)
    extra = {"max_staleness_seen": raw["max_staleness_seen"]} if "max_staleness_seen" in raw else {}
    result = system_result({0: 0.0, **raw["step_end"]}, raw["train_reward"],
                           {0: prep["sft"]["eval_reward"], **raw["eval_reward"]}, raw["startup_s"], args.thresholds,
                           seed=args.seed, **extra)
    log(f"{system}: {result['time_to_reward_s']} (steps/s {result['steps_per_s']}, "
        f"final eval {result['final_eval_reward']})")
    return result


def median_result(reps: list[dict]) -> dict:
    """Medians over reps (a rep that never reached a threshold counts as infinitely slow); the curve is rep 0's."""
    out = {**reps[0], "seeds": [r["seed"] for r in reps]}
    for key in ("startup_s", "wall_s", "steps_per_s", "final_eval_reward"):
        out[key] = round(statistics.median(r[key] for r in reps), 4)
    for key in ("time_to_reward_s", "steps_to_reward"):
        meds = {t: statistics.median(float("inf") if r[key][t] is None else r[key][t] for r in reps) for t in out[key]}
        out[key] = {t: None if m == float("inf") else round(m, 2) for t, m in meds.items()}
    if len(reps) > 1:
        out["reps"] = [{k: v for k, v in r.items() if k != "steps"} for r in reps]
    return out


def ratio(trl: dict, sluice: dict, thresholds: list[float]) -> dict | None:
    # thresholds the warm start already meets (time 0 for both) say nothing
    both = [t for t in thresholds if (trl["time_to_reward_s"][str(t)] or 0) > 0
            and (sluice["time_to_reward_s"][str(t)] or 0) > 0]
    if not both:
        return None
    t = max(both)
    return {"threshold": t, "sluice_time_over_trl_time":
            round(sluice["time_to_reward_s"][str(t)] / trl["time_to_reward_s"][str(t)], 3)}


def run_benchmark(args) -> dict:
    import transformers
    import trl

    workdir = args.workdir or tempfile.mkdtemp(prefix="sluice-ttr-")
    prep = prepare(args, workdir)
    results: dict[str, list[dict]] = {"trl": [], "sluice": []}
    for rep in range(args.reps):  # both systems are deterministic for a seed: each rep is its own RL seed
        rep_args = argparse.Namespace(**{**vars(args), "seed": args.seed + rep})
        for system in (("trl", "sluice") if rep % 2 == 0 else ("sluice", "trl")):
            results[system].append(one_rep(rep_args, system, prep, os.path.join(workdir, f"rep{rep}-{system}")))
    summary = {s: median_result(results[s]) for s in results}
    return {
        "benchmark": "time_to_reward",
        "config": {"task": "reverse 3-5 letters (benchmarks/warm_start.py), exact_match reward", "arch": "qwen2",
                   "params": prep["sft"]["params"], "rows_per_step": args.groups * args.n_samples,
                   **vars(args), "max_staleness": 0 if args.mode == "colocate" else args.max_staleness,
                   "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "trl": trl.__version__, "workdir": workdir},
        "warm_start": prep["sft"],
        "trl": summary["trl"],
        "sluice": summary["sluice"],
        "ratio": ratio(summary["trl"], summary["sluice"], args.thresholds),
        "runtime_s": round(time.perf_counter() - _T0, 1),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80, help="RL steps per run (default 80)")
    p.add_argument("--reps", type=int, default=1, help="fresh runs per system; medians over them (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke setting: 20 steps (same warm start)")
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
