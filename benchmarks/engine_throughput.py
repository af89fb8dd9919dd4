"""Built-in rollout engine throughput benchmark: prints one JSON object to stdout (progress goes to stderr).

Workload: N prompts (64; 16 with --quick) of random token ids (fixed seed), prompt lengths uniform in
[16, 64]; output lengths long-tailed: ~90% uniform in [16, 32], ~10% in (4x, 8x] of 32, the longest
exactly 8x = 256 (--quick: 4x = 128). Every request is greedy (temperature 0), EOS ignored, with its own
fixed `max_new_tokens`, so every system generates exactly the requested counts (checked). The model is a
random `sluice init-model` checkpoint, qwen2, --preset "small" (~3M parameters; the default), "tiny"
(~0.08M; --quick's default) or "medium" (~0.1B, for a GPU), float32 on CPU (--device cuda --dtype bfloat16: the
engine and every baseline on the GPU, where the targets do not apply and --cores is 1), one torch thread in
every process (--threads N gives the engine (`--torch-threads N`) and the transformers baselines N intra-op
threads alike). --cores C (default: every core of the machine, as "the speed of the machine" means) lets the
engine use C cores (`--forward-workers C`: each kind of step split over C threads or whole on C intra-op
threads, whichever it measures faster) and adds
`hf_bucketed_Ct`, the per-bucket baseline with C intra-op threads; the target then compares against the faster
per-bucket run, so transformers gets its best thread count too. --cores 1: both on one core.

Measured, interleaved per repetition (one untimed warm-up repetition first, then the median of --reps):
  engine       `sluice engine` in its own process (default flags: n-gram speculative decoding of these
               greedy requests; --speculative-algorithm none to measure without); this process sends all N
               requests at once (asyncio aiohttp, one connection each) to POST /generate, after POST /flush_cache
               (each round repeats the workload: no round drafts from an earlier one's outputs). Wall = first send to last response;
               latency = each request's send to response. Its process's CPU seconds (/proc) are reported.
  hf_bucketed  transformers `model.generate` in this process, one left-padded greedy batch per output-length
               bucket (short <= 32, long > 32, short first), max_new_tokens = the bucket's longest, EOS off;
               wall = the sum; a request's latency = the end of its bucket's batch. The headline baseline.
  hf_bucketed_static  (--static-cache) the same per-bucket batches with generate's static KV cache, which
               transformers compiles on a GPU (the warm-up repetition pays the compilation).
  hf_batched   the same with all N prompts in one batch; every latency is its wall. Information.
  hf_continuous_batching  transformers' own continuous batching in this process (`init_continuous_batching`:
               its manager on a background thread, paged KV cache sized for the whole workload, the model's
               default attention, recorded in the JSON) on its own copy of the model (transformers switches
               the attention of the model it runs to a paged one, which `generate` refuses): all N requests
               added at once, each with its own max_new_tokens, greedy, no EOS; wall = first add to last
               result; latency = each request's result. If it (or the static cache) cannot run, its error is
               recorded instead.
Useful tokens/s = the requested tokens (the same total for all) / wall; the padded baselines compute more
(`computed_tokens`). ratio_vs_X = engine useful tokens/s / X's. Target: the engine >= 3x the fastest
per-bucket run (thread count, cache) on the small preset, >= 2x on tiny (`target` in the JSON; the top-level
`ratio_vs_hf_bucketed` is that ratio). `bucket_walls_s`: each bucket's own wall in hf_bucketed (information:
two processes, one bucket each, could at best take the longest).

Greedy correctness (computed once, not timed): the reference is transformers `generate` on each prompt alone
(batch of 1, no padding, max_new_tokens = min_new_tokens = its count, eos_token_id None, greedy).
`greedy_equal_to_hf_per_request` counts the requests whose engine output ids (last timed repetition) equal it;
`greedy_all_equal` is true when all do. Agreement with hf_batched (left padding changes float32 rounding, so
near-ties may flip) and of hf_continuous_batching with the reference are information.
With --profile, the engine's Scheduler + BatchedDecoder run in this process (no HTTP, no engine thread) on
the same workload, stepped by hand, and a cProfile run's top functions are added to the JSON.

Usage: python benchmarks/engine_throughput.py [--quick] [--preset small|tiny|medium] [--reps 5] [--profile]
       [--model-dir DIR] [--threads 1] [--cores N] [--device cuda --dtype bfloat16] [--prompts N]
       [--static-cache] [--max-running N] [--reference-requests N]
"""

from __future__ import annotations

import os

# one torch/BLAS thread, set before torch loads its thread pools (children inherit it as well)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling hf_baselines module

from engine_http import engine_counters, engine_round, start_engine  # noqa: E402
from engine_profile import profile_engine  # noqa: E402
from hf_baselines import (
    SHORT_MAX,
    bucketed_computed_tokens,
    hf_batched_round,
    hf_bucketed_round,  # noqa: E402
    hf_per_request_reference,
    start_continuous_batching,
)
from services.model.init_model import init_model  # noqa: E402
from services.model.loading import load_causal_lm  # noqa: E402
from services.model.presets import PRESETS  # noqa: E402

TARGET_RATIO = {"small": 3.0, "tiny": 2.0}  # engine useful tokens/s over hf_bucketed's, per preset

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- workload


def make_workload(n: int, vocab: int, special: set[int], long_factor: int, seed: int = 0) -> list[dict]:
    """n requests: prompt ids (no special tokens) and a max_new_tokens each, long-tailed."""
    rng = random.Random(seed)
    allowed = [i for i in range(vocab) if i not in special]
    n_long = max(1, round(n * 0.1))
    longest = SHORT_MAX * long_factor
    # the long tail: spread over (longest/2, longest], the last one exactly `longest`
    long_lengths = [longest // 2 + round((longest // 2) * (k + 1) / n_long) for k in range(n_long)]
    out_lengths = [rng.randint(16, SHORT_MAX) for _ in range(n - n_long)] + long_lengths
    rng.shuffle(out_lengths)
    return [
        {"prompt": [rng.choice(allowed) for _ in range(rng.randint(16, 64))], "max_new_tokens": m} for m in out_lengths
    ]


def percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1),
    }


def with_threads(threads: int, fn, *args):
    """fn(*args) with `threads` torch intra-op threads in this process, then back to what it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------- summaries


def median_run(runs: list[dict]) -> dict:
    """The repetition with the median wall time."""
    return sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]


def summarize(runs: list[dict], useful_tokens: int, computed_tokens: int | None = None) -> dict:
    walls = [r["wall_s"] for r in runs]
    median = statistics.median(walls)
    mid = median_run(runs)  # latency percentiles are those of the repetition with the median wall time
    out = {
        "wall_s": round(median, 3),
        "useful_tokens_per_s": round(useful_tokens / median, 1),
        "latency": percentiles(mid["latencies_s"]),
        "runs_wall_s": [round(w, 3) for w in walls],
    }
    if computed_tokens is not None:
        out["computed_tokens"] = computed_tokens
        out["computed_tokens_per_s"] = round(computed_tokens / median, 1)
    if "engine_cpu_s" in runs[0]:
        cpu = statistics.median(r["engine_cpu_s"] for r in runs)
        out["engine_cpu_s"] = round(cpu, 3)
        out["engine_cpu_busy_fraction"] = round(cpu / median, 3)
    return out


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Over the requests both have (b may be the reference of the first few only)."""
    pairs = list(zip(a, b))
    same = sum(x == y for x, y in pairs)
    prefix = [len(os.path.commonprefix([x, y])) / max(1, len(x)) for x, y in pairs]
    return {
        "identical_requests": same,
        "of": len(pairs),
        "mean_common_prefix_fraction": round(float(np.mean(prefix)), 3),
    }


def prepare(args) -> dict:
    """Model, tokenizer and workload of this run."""
    torch.set_num_threads(args.threads)
    n = args.prompts or (16 if args.quick else 64)
    preset = args.preset or ("tiny" if args.quick else "small")
    log_dir = tempfile.mkdtemp(prefix="sluice-engine-bench-")
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = init_model(os.path.join(log_dir, f"model-{preset}"), preset=preset, arch="qwen2", seed=0)
        log(f"wrote a random qwen2/{preset} model to {model_dir}")
    model, tokenizer = load_causal_lm(model_dir, args.dtype, args.device)
    special = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    special |= set(tokenizer.all_special_ids)
    workload = make_workload(n, model.config.vocab_size, special, 4 if args.quick else 8, seed=args.seed)
    return {
        "n": n,
        "preset": preset,
        "reps": args.reps or (2 if args.quick else 5),
        "log_dir": log_dir,
        "model_dir": model_dir,
        "model": model,
        "tokenizer": tokenizer,
        "workload": workload,
        "useful": sum(r["max_new_tokens"] for r in workload),
        "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    }


OPTIONAL = ("hf_continuous_batching", "hf_bucketed_static")  # systems whose failure is recorded, not raised


def system_rounds(ctx: dict, url: str, pid: int, cb) -> dict:
    """name -> a function running one round of the workload on that system (None: not measured)."""
    model, workload, pad_id = ctx["model"], ctx["workload"], ctx["pad_id"]
    rounds = {
        "engine": lambda: engine_round(url, pid, workload),
        "hf_batched": lambda: hf_batched_round(model, workload, pad_id),
        "hf_bucketed": lambda: hf_bucketed_round(model, workload, pad_id),
        "hf_continuous_batching": (lambda: cb.round(workload)) if cb else None,
    }
    if ctx["static_cache"]:
        rounds["hf_bucketed_static"] = lambda: hf_bucketed_round(model, workload, pad_id, "static")
    if ctx["cores"] > 1:
        rounds[f"hf_bucketed_{ctx['cores']}t"] = lambda: with_threads(
            ctx["cores"], hf_bucketed_round, model, workload, pad_id
        )
    return rounds


def start_engine_for(ctx: dict):
    flags = [
        "--speculative-algorithm",
        ctx["speculative"],
        "--torch-threads",
        str(ctx["threads"]),
        "--forward-workers",
        str(ctx["cores"]),
        "--device",
        ctx["device"],
        "--dtype",
        ctx["dtype"],
    ]
    if ctx["max_running"]:
        flags += ["--max-running", str(ctx["max_running"])]
    proc, url = start_engine(ctx["model_dir"], ctx["log_dir"], *flags)
    log(f"engine ready at {url} (pid {proc.proc.pid})")
    return proc, url


def run_reps(ctx: dict) -> dict:
    """Warm-up + reps, the systems interleaved in every repetition; returns the timed runs per system. An
    optional system that fails is left out of the later repetitions, its error in ctx["errors"]."""
    useful, reps = ctx["useful"], ctx["reps"]
    proc, url = start_engine_for(ctx)
    cb = None
    try:
        cb, ctx["errors"]["hf_continuous_batching"] = start_continuous_batching(ctx["model"], ctx["workload"])
        ctx["cb_config"] = cb.config if cb else None
        log(f"transformers continuous batching: {ctx['cb_config'] or ctx['errors']['hf_continuous_batching']}")
        runs: dict[str, list[dict]] = {name: [] for name in system_rounds(ctx, url, proc.proc.pid, None)}
        runs["hf_continuous_batching"] = []
        for rep in range(reps + 1):
            tag = "warm-up" if rep == 0 else f"rep {rep}/{reps}"
            for name, fn in system_rounds(ctx, url, proc.proc.pid, cb).items():
                if fn is None or ctx["errors"].get(name):
                    continue
                try:
                    run = fn()
                except Exception as exc:
                    if name not in OPTIONAL:
                        raise
                    log(f"{tag}: {name} failed: {exc!r}")
                    ctx["errors"][name], runs[name] = f"{type(exc).__name__}: {exc}", []
                    if name == "hf_continuous_batching":
                        cb.close()
                        cb = None
                    continue
                extra = f", engine cpu {run['engine_cpu_s']:.2f}s" if "engine_cpu_s" in run else ""
                log(f"{tag}: {name} {run['wall_s']:.2f}s ({useful / run['wall_s']:.0f} useful tok/s{extra})")
                if rep > 0:
                    runs[name].append(run)
        ctx["engine_counters"] = engine_counters(url)
    finally:
        proc.stop()
        if cb is not None:
            cb.close()
    return runs


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name (Linux /proc/cpuinfo)."""
    if device != "cpu":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def describe(ctx: dict) -> dict:
    workload, model = ctx["workload"], ctx["model"]
    lengths = [r["max_new_tokens"] for r in workload]
    prompts = [len(r["prompt"]) for r in workload]
    return {
        "quick": ctx["quick"],
        "prompts": ctx["n"],
        "preset": ctx["preset"],
        "arch": "qwen2",
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": ctx["dtype"],
        "device": ctx["device"],
        "device_name": device_name(ctx["device"]),
        "reps": ctx["reps"],
        "seed": ctx["seed"],
        "prompt_tokens": {"min": min(prompts), "max": max(prompts), "total": sum(prompts)},
        "output_tokens": {
            "min": min(lengths),
            "p50": int(statistics.median(lengths)),
            "max": max(lengths),
            "total": ctx["useful"],
            "long_requests": sum(m > SHORT_MAX for m in lengths),
        },
        "torch_threads": torch.get_num_threads(),
        "engine_forward_workers": ctx["cores"],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def systems(ctx: dict, runs: dict) -> dict:
    """The per-system summaries and the engine's ratios over each baseline."""
    workload, useful = ctx["workload"], ctx["useful"]
    out = {
        "engine": {
            **summarize(runs["engine"], useful),
            "speculative_algorithm": ctx["speculative"],
            "counters_all_rounds": ctx["engine_counters"],
        },
        "hf_bucketed": summarize(runs["hf_bucketed"], useful, computed_tokens=bucketed_computed_tokens(workload)),
        "hf_batched": summarize(
            runs["hf_batched"], useful, computed_tokens=len(workload) * max(r["max_new_tokens"] for r in workload)
        ),
    }
    cb_error = ctx["errors"].get("hf_continuous_batching")
    if runs["hf_continuous_batching"] and cb_error is None:
        out["hf_continuous_batching"] = {**ctx["cb_config"], **summarize(runs["hf_continuous_batching"], useful)}
    else:
        out["hf_continuous_batching"] = {"error": cb_error, **(ctx["cb_config"] or {})}
    out["hf_bucketed"]["bucket_walls_s"] = bucket_walls(runs["hf_bucketed"])
    wide, static = f"hf_bucketed_{ctx['cores']}t", "hf_bucketed_static"
    for name in (wide, static):
        if runs.get(name):
            out[name] = summarize(runs[name], useful, computed_tokens=bucketed_computed_tokens(workload))
        elif name in runs:
            out[name] = {"error": ctx["errors"].get(name)}
    if static in out:
        out[static]["cache_implementation"] = "static"
    engine_tps = out["engine"]["useful_tokens_per_s"]
    ratios = {
        f"ratio_vs_{name}": round(engine_tps / out[name]["useful_tokens_per_s"], 3)
        for name in ("hf_bucketed", wide, static, "hf_batched", "hf_continuous_batching")
        if "useful_tokens_per_s" in out.get(name, {})
    }
    ratios.setdefault("ratio_vs_hf_continuous_batching", None)
    # the target's baseline: the fastest per-bucket generate (thread count, cache) measured: more threads can
    # make it slower, a static cache faster
    best = min(
        (name for name in ("hf_bucketed", wide, static) if "wall_s" in out.get(name, {})),
        key=lambda name: out[name]["wall_s"],
    )
    return {**out, **ratios, "target_baseline": best, "ratio_vs_target_baseline": ratios[f"ratio_vs_{best}"]}


def bucket_walls(runs: list[dict]) -> list[float]:
    """Each length bucket's own wall time in the median repetition (information: two processes, one bucket
    each, could at best take the longest of them)."""
    ends = sorted(set(median_run(runs)["latencies_s"]))
    return [round(b - a, 3) for a, b in zip([0.0, *ends], ends)]


def greedy(ctx: dict, runs: dict, reference: list[list[int]]) -> dict:
    engine_out = runs["engine"][-1]["outputs"]
    same = sum(a == b for a, b in zip(engine_out, reference))
    out = {
        "greedy_all_equal": same == len(reference),
        "greedy_equal_to_hf_per_request": {
            "identical_requests": same,
            "of": len(reference),
            "engine_same_on_every_rep": all(r["outputs"] == engine_out for r in runs["engine"]),
        },
        "greedy_agreement_engine_vs_hf_batched": greedy_agreement(engine_out, runs["hf_batched"][-1]["outputs"]),
    }
    if runs["hf_continuous_batching"] and ctx["errors"].get("hf_continuous_batching") is None:
        out["greedy_agreement_hf_continuous_batching_vs_hf_per_request"] = greedy_agreement(
            runs["hf_continuous_batching"][-1]["outputs"], reference
        )
    return out


def run_benchmark(args) -> dict:
    ctx = prepare(args)
    ctx.update(
        quick=args.quick,
        seed=args.seed,
        speculative=args.speculative_algorithm,
        threads=args.threads,
        cores=args.cores if args.device == "cpu" else 1,
        device=args.device,
        dtype=args.dtype,
        static_cache=args.static_cache,
        max_running=args.max_running,
        errors={},
    )
    config = describe(ctx)
    log(
        f"{ctx['n']} requests, {ctx['useful']} output tokens (max {config['output_tokens']['max']}), "
        f"{config['params'] / 1e6:.2f}M params; {ctx['reps']} reps + 1 warm-up; logs in {ctx['log_dir']}"
    )
    checked = ctx["workload"][: args.reference_requests]  # None: all of them
    reference = hf_per_request_reference(ctx["model"], checked, ctx["pad_id"])
    log(f"computed the per-request greedy reference of {len(checked)} requests")
    runs = run_reps(ctx)
    summaries = systems(ctx, runs)
    # the targets are the CPU float32 ones of the small and tiny presets; elsewhere the ratios are information
    ratio_min = TARGET_RATIO.get(ctx["preset"]) if (args.device, args.dtype) == ("cpu", "float32") else None
    headline = summaries["ratio_vs_target_baseline"]
    result = {
        "benchmark": "engine_throughput",
        "config": config,
        "ratio_vs_hf_bucketed": headline,
        "target": {
            "baseline": summaries["target_baseline"],
            "ratio_min": ratio_min,
            "met": headline >= ratio_min if ratio_min is not None else None,
        },
        **greedy(ctx, runs, reference),
        **summaries,
    }
    if args.profile:
        log("profiling the engine's scheduler in-process")
        result["engine_in_process_profile"] = profile_engine(ctx["model"], ctx["tokenizer"], ctx["workload"])
    result["runtime_s"] = round(time.perf_counter() - _T0, 1)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 16 prompts, tiny preset, outputs up to 128")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; 2 with --quick)")
    p.add_argument("--prompts", type=int, default=None, help="number of requests (default 64; 16 with --quick)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model preset, which also sets the target (default small, target 3x; tiny with --quick, 2x; "
        "medium, ~0.1B parameters for a GPU, has none)",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="use this model directory (of --preset's shape) instead of writing a fresh one",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--profile", action="store_true", help="also cProfile the engine's scheduler in-process")
    p.add_argument(
        "--speculative-algorithm",
        choices=["ngram", "none"],
        default="ngram",
        help="the engine's --speculative-algorithm (its default: ngram)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of the engine (--torch-threads) "
        "and of the transformers baselines alike (default 1)",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count() or 1,
        help="cores the engine may use: its "
        "--forward-workers; the per-bucket baseline is then also measured with that many intra-op threads "
        "and the faster of the two is the target's baseline (default: every core, %(default)s here)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the engine and the transformers baselines run: cpu or "
        "cuda[:N] (on a GPU --cores is 1: the engine's --forward-workers split CPU steps only)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="weights dtype of the engine and the baselines alike (the targets are float32 on CPU)",
    )
    p.add_argument(
        "--static-cache",
        action="store_true",
        help="also measure hf_bucketed_static: per-bucket "
        "generate with cache_implementation='static' (which transformers compiles on a GPU)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="the engine's --max-running (its KV slots; default: the engine's own, 64)",
    )
    p.add_argument(
        "--reference-requests",
        type=int,
        default=None,
        help="compute the per-request greedy "
        "reference (not timed, one generate per request) of the first N requests only (default: all)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(json.dumps(run_benchmark(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
