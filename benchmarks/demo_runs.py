"""One `sluice demo` run driven from a benchmark script, and what it leaves behind, for benchmarks/dynamic_sampling.py
and benchmarks/lora_vs_full.py.

The run is the demo's own (services/demo.py: its flags' defaults, its warm-started model, its RunFile), with the
caller's changes to the run config (rollout.filter_groups, trainer.lora, optim.lr), started as services/launch/
local_run.py's stack (private Redis, TransferQueue, coordinator, one built-in engine, rollout, advantage, trainer:
each its own process) and followed to its last step. Two changes to every run measured, the same for each setting:
tracking writes no TensorBoard events (`report_to: none`) and logs every trained sample to completions.jsonl
(`completions_every: 1`, `completions_rows` = the step's rows), so the zero-variance groups of each trained step can
be counted (a group = the step's samples of one prompt).

What a run returns (`demo_run`):

  steps          per step: end (seconds after step 0 ended), reward_mean, filtered_groups (groups dynamic
                 sampling dropped for the step), publish_bytes and publish_s (the weight publish tracked with the
                 step: the previous step's, as it overlaps this one), max staleness
  zero_variance  per step: the trained groups whose rewards were all equal, and the groups trained
  evals          (version, held-out mean reward) of every held-out eval (greedy, 128 prompts every 5 versions)
  first_at       the first eval whose mean reward >= the threshold: version (= steps trained) and seconds after
                 step 0 ended (its finish), or None
  spans          median seconds of the trainer's `publish` spans and the engine's `weight_load` spans
  trainer_peak_rss_mb   the trainer process's peak resident memory (VmHWM of /proc/<pid>/status, read while it
                 runs; the whole process: Python, torch, the model, gradients and optimizer state)
  exactly_once   every trained sample distinct, num_steps x rows of them
"""

from __future__ import annotations

import os

# one thread per process, offline, set before torch loads: the benchmark scripts import this module first
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Callable  # noqa: E402

from services.demo import build_run, parse_args, prepare_model  # noqa: E402
from services.launch.local_run import LocalRun  # noqa: E402
from services.tracking.timeline import fetch_spans  # noqa: E402
from services.run_contract.run_config import RunConfig  # noqa: E402
from services.run_state.evaluations import read_evaluations  # noqa: E402
from services.run_state.trainer_progress import read_progress, trained_steps  # noqa: E402

_T0 = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr, seconds since the benchmark began (stdout is kept for its JSON)."""
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def demo_args(seed: int, steps: int, extra: list[str] = ()):
    """`sluice demo --seed S --steps N ...`'s arguments, every other flag at its default."""
    return parse_args(["--seed", str(seed), "--steps", str(steps), "--view", "json", *extra])


def recorded(path: str, measure: Callable[[], dict]) -> dict:
    """The result saved at `path` by an earlier invocation (so that a benchmark stopped part-way, e.g. by a service
    that failed to start, goes on from the runs it finished), else measure() saved there."""
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    result = measure()
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


def warm_model(args, workdir: str) -> str:
    """The demo's model for this seed: a new random model, warm-started (done once per seed, shared by settings)."""
    return prepare_model(args, workdir)


def demo_config(args, model_dir: str, workdir: str, changes: dict) -> RunConfig:
    """The demo's run config with `changes` ({section: {field: value}}) merged in, validated again."""
    data = build_run(args, model_dir, workdir).run_config().model_dump(mode="json")
    rows = data["global_batch_size"]
    changes = {
        **changes,
        "tracking": {
            "report_to": ["none"],
            "completions_every": 1,
            "completions_rows": rows,
            **changes.get("tracking", {}),
        },
    }
    for section, fields in changes.items():
        data[section] = {**(data.get(section) or {}), **fields}
    return RunConfig.model_validate(data)


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set size) of a live process, in MiB; None once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def follow(local: LocalRun, run: RunConfig, timeout_s: float) -> tuple[dict[int, float], float | None]:
    """Until the trainer finished the last step: (step -> Unix time it was seen finished, trainer peak RSS MiB)."""
    ended: dict[int, float] = {}
    trainer_pid, peak = local.procs["trainer"].proc.pid, None
    deadline = time.monotonic() + timeout_s
    with local.redis_client() as r:
        while len(ended) < run.num_steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ended)} of {run.num_steps} steps after {timeout_s}s; logs in {local.log_dir}")
            peak = max(filter(None, [peak, peak_rss_mb(trainer_pid)]), default=None)
            next_step, now = read_progress(r, run.name).next_step, time.time()
            for s in range(len(ended), next_step):
                ended[s] = now
            if next_step < run.num_steps:
                local.check_alive()
                time.sleep(0.2)
    return ended, peak


def median_span(spans: dict[str, list[dict]], lane: str, name: str) -> float | None:
    durations = [s["end"] - s["start"] for s in spans.get(lane, []) if s["name"] == name]
    return round(statistics.median(durations), 4) if durations else None


def zero_variance_per_step(completions_path: str) -> dict[int, dict]:
    """step -> {zero_variance, groups} from the trainer's completions.jsonl (every trained sample of every step)."""
    groups: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(completions_path) as f:
        for line in f:
            row = json.loads(line)
            groups[row["step"]][row["prompt"]].append(row["reward"])
    return {
        step: {"zero_variance": sum(len(set(r)) == 1 for r in by_prompt.values()), "groups": len(by_prompt)}
        for step, by_prompt in sorted(groups.items())
    }


def step_rows(done: dict[int, dict], ended: dict[int, float]) -> list[dict]:
    t0 = ended[0]
    rows = []
    for s in sorted(done):
        m = done[s]["metrics"]
        rows.append(
            {
                "step": s,
                "end_s": round(ended.get(s, t0) - t0, 3),
                "reward_mean": round(m["reward_mean"], 4),
                "filtered_groups": m.get("filtered_groups", 0),
                "publish_bytes": m.get("publish_bytes"),
                "publish_s": m.get("publish_s"),
                "staleness_max": max(int(k) for k in m["staleness"]),
            }
        )
    return rows


def first_at(evals: list, t0: float, threshold: float) -> dict | None:
    for e in evals:
        if e.mean_reward >= threshold:
            return {"version": e.version, "seconds": round(e.finished_at - t0, 2), "eval_reward": e.mean_reward}
    return None


def demo_run(run: RunConfig, workdir: str, threshold: float = 0.8, timeout_s: float = 3600.0) -> dict:
    """One run of `run` (a demo_config) to its last step; what it leaves behind (the module's docstring)."""
    log_dir = os.path.join(workdir, "logs")
    started = time.monotonic()
    with LocalRun(run, log_dir=log_dir) as local:
        ended, peak = follow(local, run, timeout_s)
        wall_s = time.monotonic() - started
        with local.redis_client() as r:
            done, evals = trained_steps(r, run.name), read_evaluations(r, run.name)
        spans = fetch_spans(local.service_urls())
    # read once the trainer has stopped: its tracking thread writes every queued step before it exits
    zero = zero_variance_per_step(os.path.join(log_dir, run.name, "completions.jsonl"))
    samples = [s for rec in done.values() for s in rec["samples"]]
    return {
        "steps": step_rows(done, ended),
        "zero_variance": zero,
        "evals": [(e.version, round(e.mean_reward, 4)) for e in evals],
        "first_at": first_at(evals, ended[0], threshold),
        "wall_s": round(wall_s, 1),
        "spans": {
            "trainer_publish_s": median_span(spans, "trainer", "publish"),
            "engine_weight_load_s": median_span(spans, "engine-0", "weight_load"),
        },
        "trainer_peak_rss_mb": round(peak, 1) if peak else None,
        "exactly_once": len(samples) == len(set(samples)) == run.num_steps * run.rows_per_step,
    }
