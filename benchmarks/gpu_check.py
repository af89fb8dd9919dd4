"""One prepared check of Sluice on one GPU: prints ONE JSON object on stdout (progress on stderr), in at most
6 minutes on one H100. Each part runs as child processes under its own time budget (160 + 110 + 75 s by
default; past it a part is interrupted, then killed 8 s later, and what it had reported is kept); a part that
fails is reported as failed, with its error and log tail, and the others still run.

  run                (a) the whole run of deploy/one_gpu.yaml under `sluice run` (a random medium-preset
                     model written by `sluice init-model` into a temporary directory; a bfloat16 engine and
                     the trainer on the same GPU; demo:letters, 32 groups x 8 samples, 128 new tokens,
                     max_staleness 2, 20 steps): steps finished, samples/s and trained tokens/s (over the steps
                     after the first), start-up seconds (launch of `sluice run` to the first step recorded;
                     services_up_s: to its `running` event), the trainer's wait fraction (sum wait_s / sum
                     step_s from the run's steps.jsonl; the first step's step_s counts from the trainer's
                     start, so the rates and fractions are over the later steps), GPU busy through NVML every
                     250 ms (pynvml, else nvidia-smi) from the first step's record to the last's, publish
                     seconds per step (and as a fraction of a step), and exit_s: how long `sluice run` took
                     to exit after its `finished` line.
  engine             (b) benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --preset medium on 256
                     requests (--max-running 256: the engine's KV slots hold them all): the built-in engine
                     against transformers `generate` per output-length bucket with its dynamic cache and
                     with a static one (compiled by transformers on a GPU), in one batch, and transformers'
                     continuous batching, all in the same process run; tokens/s and ratios from its JSON.
  cuda_tests         (c) pytest on every test file with tests skipped without CUDA (found by their
                     `torch.cuda.is_available()` skip): passed / failed / skipped / errors, the failures named.

Without CUDA every part is reported as skipped (no GPU) in a few seconds. --cpu-smoke runs every part on the
CPU at smoke size (a tiny model, 3 steps of 4 groups x 4 samples x 16 tokens; 8 requests; the CUDA tests
skip themselves) to check the plumbing. Exit status 0 unless a part failed.

On the device machine (its image has torch, transformers, pytest, pynvml; ../shared/tools/gpu_prepare.sh
makes .gpu/ here with the rest: the services' wheels and redis-server; carry [".gpu"]):
    source .gpu/env.sh && python benchmarks/gpu_check.py
Usage: python benchmarks/gpu_check.py [--cpu-smoke] [--parts run,engine,cuda_tests] [--steps N]
       [--budget-run 160] [--budget-engine 110] [--budget-tests 75]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from importlib import metadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling gpu_check_run module

from gpu_check_run import ROOT, log, run_child, run_one_gpu, stderr_tail  # noqa: E402

PARTS = ("run", "engine", "cuda_tests")
# (b): the 256 requests of the engine figure; the reference (one generate per request, not timed) of
# a few only, so the GPU's minutes go to the timed systems
ENGINE_ARGS = {
    "cuda": [
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--preset",
        "medium",
        "--prompts",
        "256",
        "--max-running",
        "256",
        "--static-cache",
        "--reps",
        "2",
        "--reference-requests",
        "8",
    ],
    "cpu": [
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--prompts",
        "8",
        "--max-running",
        "8",
        "--static-cache",
        "--reps",
        "1",
        "--cores",
        "1",
        "--reference-requests",
        "4",
    ],
}
ENGINE_SYSTEMS = ("engine", "hf_bucketed", "hf_bucketed_static", "hf_batched", "hf_continuous_batching")


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine(cuda: bool) -> dict:
    out = {
        "cuda": cuda,
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "cpus": os.cpu_count(),
    }
    if cuda:  # the name from NVML: no CUDA context in this process, whose children use the GPU
        try:
            import pynvml

            pynvml.nvmlInit()
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            out["gpu"] = name.decode() if isinstance(name, bytes) else name
        except Exception as exc:
            out["gpu"] = f"unknown ({type(exc).__name__})"
    return out


# ---------------------------------------------------------------------------------- (b) the engine


def engine_part(device: str, budget_s: float) -> dict:
    """benchmarks/engine_throughput.py as a child; the figures of its JSON."""
    work = tempfile.mkdtemp(prefix="sluice-gpu-check-engine-")
    argv = [sys.executable, os.path.join(ROOT, "benchmarks", "engine_throughput.py"), *ENGINE_ARGS[device]]
    log(f"engine_throughput.py {' '.join(ENGINE_ARGS[device])} (logs in {work})")
    child = run_child(argv, budget_s, os.path.join(work, "engine_throughput.stderr"))
    base = {
        "command": " ".join(["python benchmarks/engine_throughput.py", *ENGINE_ARGS[device]]),
        "rc": child["rc"],
        "timed_out": child["timed_out"],
        "seconds": child["seconds"],
        "budget_s": budget_s,
    }
    try:
        result = json.loads("\n".join(text for _, text in child["lines"]))
    except ValueError:  # no JSON (stopped past its budget, or broken): the rounds it logged, and its end
        errors = os.path.join(work, "engine_throughput.stderr")
        return {"status": "failed", **base, "rounds_logged": logged_rounds(errors), "stderr_tail": stderr_tail(errors)}
    systems = {}
    for name in ENGINE_SYSTEMS:
        figures = result.get(name) or {}
        systems[name] = {
            k: figures[k]
            for k in ("useful_tokens_per_s", "wall_s", "runs_wall_s", "error", "attn_implementation")
            if k in figures
        }
    config = result.get("config", {})
    return {
        "status": "ok" if child["rc"] == 0 else "failed",
        **base,
        "systems": systems,
        "ratios": {k: v for k, v in result.items() if k.startswith("ratio_vs_")},
        "target_baseline": result.get("target_baseline"),
        "greedy_equal_to_hf_per_request": result.get("greedy_equal_to_hf_per_request"),
        "engine_counters": result.get("engine", {}).get("counters_all_rounds"),
        "workload": {
            "prompts": config.get("prompts"),
            "output_tokens": config.get("output_tokens"),
            "params": config.get("params"),
            "device_name": config.get("device_name"),
        },
    }


ROUND = re.compile(r"\] (warm-up|rep \d+/\d+): (\S+) ([\d.]+)s \((\d+) useful tok/s")


def logged_rounds(path: str) -> dict:
    """system -> ["warm-up: 1234 tok/s", ...] from engine_throughput.py's progress lines (on stderr)."""
    rounds: dict[str, list[str]] = {}
    try:
        with open(path, errors="replace") as f:
            for match in ROUND.finditer(f.read()):
                rounds.setdefault(match[2], []).append(f"{match[1]}: {match[4]} tok/s")
    except OSError:
        pass
    return rounds


# ---------------------------------------------------------------------------------- (c) the CUDA tests

CUDA_SKIP = re.compile(r"torch\.cuda\.(is_available|device_count)\(\)")


def cuda_test_files() -> list[str]:
    """Test files with tests that skip without CUDA (`torch.cuda.is_available()` or `.device_count()` beside a
    skip)."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)):
        with open(path, errors="replace") as f:
            text = f.read()
        if CUDA_SKIP.search(text) and ("skipif" in text or "pytest.skip" in text):
            found.append(os.path.relpath(path, ROOT))
    return found


def junit_counts(path: str) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for s in suites
        for case in s.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failed_tests": failed,
    }


def tests_part(device: str, budget_s: float) -> dict:
    files = cuda_test_files()
    if not files:
        return {"status": "failed", "error": "no test file with a CUDA skip found under tests/"}
    work = tempfile.mkdtemp(prefix="sluice-gpu-check-tests-")
    junit = os.path.join(work, "junit.xml")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    log(f"pytest {' '.join(files)} (logs in {work})")
    child = run_child(argv, budget_s, os.path.join(work, "pytest.stderr"))
    out = {
        "files": files,
        "rc": child["rc"],
        "timed_out": child["timed_out"],
        "seconds": child["seconds"],
        "budget_s": budget_s,
        "output_tail": "\n".join(text for _, text in child["lines"][-15:]),
    }
    if not os.path.exists(junit):
        return {"status": "failed", **out, "stderr_tail": stderr_tail(os.path.join(work, "pytest.stderr"))}
    counts = junit_counts(junit)
    ok = child["rc"] == 0 and not counts["failed"] and not counts["errors"]
    return {"status": "ok" if ok else "failed", **counts, **out}


# ---------------------------------------------------------------------------------- the check


def guarded(name: str, fn, *args) -> dict:
    """One part: its result, or how it broke (the other parts still run)."""
    started = time.time()
    log(f"part {name}: start")
    try:
        result = fn(*args)
    except Exception as exc:
        result = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-2000:],
        }
    result["part_s"] = round(time.time() - started, 1)
    log(f"part {name}: {result['status']} in {result['part_s']} s")
    return result


def check(args) -> dict:
    import torch  # after argparse: --help needs no torch

    cuda = torch.cuda.is_available()
    device = "cpu" if args.cpu_smoke else "cuda"
    budgets = {"run": args.budget_run, "engine": args.budget_engine, "cuda_tests": args.budget_tests}
    functions = {
        "run": lambda: run_one_gpu(device, budgets["run"], args.steps),
        "engine": lambda: engine_part(device, budgets["engine"]),
        "cuda_tests": lambda: tests_part(device, budgets["cuda_tests"]),
    }
    parts = {}
    for name in PARTS:
        if name not in args.parts:
            parts[name] = {"status": "skipped", "reason": "not asked for (--parts)"}
        elif device == "cuda" and not cuda:
            parts[name] = {
                "status": "skipped",
                "reason": "no GPU: torch sees no CUDA device (--cpu-smoke runs every part on the CPU at smoke size)",
            }
        else:
            parts[name] = guarded(name, functions[name])
    return {
        "benchmark": "gpu_check",
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "machine": machine(cuda),
        "ok": all(p["status"] in ("ok", "skipped") for p in parts.values()),
        "parts": parts,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="every part on the CPU at smoke size (the plumbing)")
    p.add_argument(
        "--parts",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=list(PARTS),
        help=f"which parts to run, comma-separated (default: {','.join(PARTS)})",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="the run's num_steps (default: the run file's; 3 with --cpu-smoke)"
    )
    p.add_argument("--budget-run", type=float, default=160.0, help="seconds for part (a), model writing included")
    p.add_argument("--budget-engine", type=float, default=110.0, help="seconds for part (b)")
    p.add_argument("--budget-tests", type=float, default=75.0, help="seconds for part (c)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; of {', '.join(PARTS)}")
    return args


def main(argv=None) -> int:
    started = time.time()
    result = check(parse_args(argv))
    result["runtime_s"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
