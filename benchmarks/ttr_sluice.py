"""The `sluice` system of benchmarks/time_to_reward.py: services/launch/local_run.py's stack (redis,
TransferQueue, coordinator, one built-in engine, rollout, advantage and trainer processes, one torch thread
each, as `sluice run` starts them), its rollout started last and the clock started when it reports ready.
The run's RunConfig is also the in-process loop's (colocate mode)."""

from __future__ import annotations

import os
import time

from services.engine.config import EngineConfig
from services.launch.local_run import LocalRun
from services.run_contract.checkpoint import checkpoints
from services.run_contract.run_config import RunConfig
from services.run_state.trainer_progress import read_progress, trained_steps
from services.runtime.processes import http_ok
from ttr_args import off_policy_settings
from ttr_summary import evaluate
from ttr_tasks import TASKS

RUN_ID = "bench-time-to-reward"
HERE = os.path.dirname(os.path.abspath(__file__))


class TimedRun(LocalRun):
    """LocalRun whose rollout starts last, once the whole stack is up (the run created) and every other role
    is ready: the rollout reporting ready (its generation loop begins) is the start of training,
    `rollout_ready_at`. Hooks _wait_ready, the last step of LocalRun's start whatever order it starts the rest in."""

    rollout_ready_at: float | None = None
    _hold_rollout = True

    def _wait_ready(self) -> None:
        super()._wait_ready()
        for name, proc in list(self.procs.items()):
            if not name.startswith("engine"):
                proc.wait_until(lambda p=proc: http_ok(p.status_url + "/readyz"), 300)
        self._hold_rollout = False
        rollout = self.start_role("rollout", wait=False)
        rollout.wait_until(lambda: http_ok(rollout.status_url + "/readyz"), 300)
        self.rollout_ready_at = time.monotonic()

    def start_role(self, name: str, wait: bool = True):
        if name == "rollout" and self._hold_rollout:
            return None  # LocalRun starts every role; ours waits for _wait_ready
        return super().start_role(name, wait=wait)


def sluice_config(args, warm_dir: str, prompts_path: str) -> RunConfig:
    rows = args.groups * args.n_samples
    return RunConfig(
        name=RUN_ID,
        model=warm_dir,
        mode=args.mode,
        max_staleness=0 if args.mode == "colocate" else args.max_staleness,
        n_samples_per_prompt=args.n_samples,
        rollout_batch_size=args.groups,
        global_batch_size=rows,
        micro_batch_size=args.micro_batch_size,
        num_steps=args.steps,
        checkpoint_interval=args.eval_every,
        algorithm={
            "estimator": "grpo",
            "kl_coef": 0.0,
            "eps_clip": 0.2,
            "loss_agg": "token_mean",
            **off_policy_settings(getattr(args, "off_policy", "plain")),
        },
        rollout={
            "prompts": prompts_path,
            "reward": TASKS[args.task].reward_spec,
            "label_field": "label",
            "apply_chat_template": True,
            "shuffle_seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
        },
        optim={"lr": args.lr, "weight_decay": 0.0, "grad_clip": 1.0, "seed": args.seed},
    )


def capture(ckpt_dir: str, snap_dir: str, snaps: dict[int, str], log) -> None:
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


def follow_steps(local: TimedRun, run: RunConfig, args, ckpt_dir: str, snap_dir: str, log) -> tuple[dict, dict]:
    """Polls the trainer's progress every --poll-ms until the last step: (step -> end time, step -> snapshot)."""
    t0 = local.rollout_ready_at
    step_end: dict[int, float] = {}
    snaps: dict[int, str] = {}
    with local.redis_client() as r:
        while len(step_end) < run.num_steps:
            if time.monotonic() - t0 > args.timeout_s:
                raise TimeoutError(
                    f"sluice: {len(step_end)} of {run.num_steps} steps after {args.timeout_s}s; logs in {local.log_dir}"
                )
            next_step = read_progress(r, run.name).next_step
            now = time.monotonic() - t0
            for s in range(len(step_end) + 1, next_step + 1):
                step_end[s] = now  # steps counted from 1, as TRL's global_step
            capture(ckpt_dir, snap_dir, snaps, log)
            if next_step < run.num_steps:
                local.check_alive()
                time.sleep(args.poll_ms / 1e3)
    # the last checkpoint is written off the step (services/trainer/checkpoint_copy.py): wait for it, untimed
    last_due, deadline = run.num_steps // args.eval_every * args.eval_every, time.monotonic() + 60
    while True:
        capture(ckpt_dir, snap_dir, snaps, log)
        if last_due in snaps or last_due == 0 or time.monotonic() > deadline:
            break
        local.check_alive()
        time.sleep(args.poll_ms / 1e3)
    return step_end, snaps


def run_sluice(args, warm_dir: str, prompts_path: str, eval_rows: list[dict], workdir: str, tokenizer, log) -> dict:
    run = sluice_config(args, warm_dir, prompts_path)
    ckpt_dir, snap_dir = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "snapshots")
    started = time.monotonic()
    # python_path: the short task's `import:ttr_tasks:position_credit` reward is imported by the rollout
    with TimedRun(
        run, log_dir=os.path.join(workdir, "logs"), checkpoint_dir=ckpt_dir, python_path=(HERE, os.path.dirname(HERE))
    ) as local:
        t0 = local.rollout_ready_at
        processes = sorted(local.processes())
        log(f"sluice: stack ready after {t0 - started:.1f}s ({', '.join(processes)})")
        step_end, snaps = follow_steps(local, run, args, ckpt_dir, snap_dir, log)
        with local.redis_client() as r:
            done = trained_steps(r, run.name)
    train_reward = {s + 1: float(rec["metrics"]["reward_mean"]) for s, rec in done.items()}
    staleness = max(int(k) for rec in done.values() for k in rec["metrics"]["staleness"])
    log(f"sluice: {run.num_steps} steps in {max(step_end.values()):.1f}s; evaluating {len(snaps)} checkpoints")
    evals = evaluate(snaps, tokenizer, eval_rows, args.max_new_tokens, TASKS[args.task].score)
    engine = EngineConfig.model_fields
    threads = {
        "per_role_process": 1,
        "engine_torch_threads": engine["torch_threads"].default,
        "engine_forward_workers": engine["forward_workers"].default,
        "processes": processes,
        "cpus": os.cpu_count(),
    }
    return {
        "step_end": step_end,
        "train_reward": train_reward,
        "eval_reward": evals,
        "startup_s": t0 - started,
        "max_staleness_seen": staleness,
        "torch_threads": 1,
        "threads": threads,
    }
