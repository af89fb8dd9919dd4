"""Built-in rollout engine throughput benchmark: prints one JSON object to stdout (progress goes to stderr).

Workload: N prompts (64; 16 with --quick) of random token ids (fixed seed), prompt lengths uniform in
[16, 64]; output lengths long-tailed: ~90% uniform in [16, 32], ~10% in (4x, 8x] of 32, the longest
exactly 8x = 256 (--quick: the tiny preset, 4x = 128). Every request is greedy (temperature 0) with
`ignore_eos` and its own fixed `max_new_tokens`, so both systems generate exactly the requested
token counts. The model is a random `sluice init-model` checkpoint (qwen2, preset "small", ~3M
parameters; "tiny" with --quick), float32 on CPU, one torch thread in every process.

Measured, interleaved per repetition (one untimed warm-up repetition first, then the median of --reps):
  engine     `sluice engine` in its own process; this process sends all N requests at once (asyncio
             httpx, one connection each) to POST /generate. Wall = first send to last response;
             tokens/s = total generated tokens / wall; latency = each request's send to response.
             The engine process's CPU seconds (from /proc) are reported beside the wall time.
  hf_batched transformers `model.generate` in this process, the way a user batches: all N prompts
             left-padded into one batch with max_new_tokens = the longest request, greedy, EOS off.
             The batch runs until its longest row finishes, so "useful" tokens/s counts only the
             requested tokens (the same total as the engine) over its wall time; every request's
             latency is the whole batch's wall.
  hf_bucketed  the same, one batch per output-length bucket (short <= 32, long > 32), run one after
             the other (short first); a request's latency is the end of its bucket's batch.
  ratio      engine tokens/s / hf_batched useful tokens/s; target >= 1.5.

Also: greedy agreement (fraction of requests whose engine output equals HF's batched output; random
weights have near-ties, and left padding changes float32 rounding, so this is information, not a test).
With --profile, the engine's scheduler runs in this process (no HTTP) under cProfile on the same
workload, and the top functions by cumulative and own time are added to the JSON.

--quick is a smoke test of the harness: on the 0.08M-parameter tiny model every step is Python
overhead, so its ratio says nothing about the target.

Usage: python benchmarks/engine_throughput.py [--quick] [--reps 5] [--profile] [--model-dir DIR]
"""

from __future__ import annotations

import os

# one torch/BLAS thread, set before torch loads its thread pools (children inherit it as well)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from services.model.init_model import init_model  # noqa: E402
from services.model.loading import load_causal_lm  # noqa: E402
from services.runtime.processes import ChildProcess, free_port, http_ok, sluice_argv  # noqa: E402

TARGET_RATIO = 1.5
SHORT_MAX = 32  # bucket boundary for hf_bucketed; the short outputs are in [16, 32]

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
    return [{"prompt": [rng.choice(allowed) for _ in range(rng.randint(16, 64))], "max_new_tokens": m}
            for m in out_lengths]


def percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "max_ms": round(float(ms.max()), 1)}


# ---------------------------------------------------------------------------------- engine


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_engine(model_dir: str, log_dir: str) -> tuple[ChildProcess, str]:
    port = free_port()
    proc = ChildProcess("engine", sluice_argv("engine", "--model", model_dir, "--host", "127.0.0.1",
                                              "--port", str(port), "--log-level", "warning"),
                        os.path.join(log_dir, f"engine-{port}.log"), env={"HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/health"), 120)
    return proc, url


async def _engine_round(url: str, workload: list[dict]) -> tuple[float, list[float], list[list[int]]]:
    limits = httpx.Limits(max_connections=len(workload) + 4, max_keepalive_connections=len(workload) + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async def one(req: dict) -> tuple[float, list[int]]:
            body = {"input_ids": req["prompt"],
                    "sampling_params": {"max_new_tokens": req["max_new_tokens"], "temperature": 0,
                                        "ignore_eos": True}}
            start = time.perf_counter()
            r = await client.post("/generate", json=body)
            seconds = time.perf_counter() - start
            if r.status_code != 200:
                raise RuntimeError(f"engine answered {r.status_code}: {r.text[:500]}")
            out = r.json()
            if out["meta_info"]["completion_tokens"] != req["max_new_tokens"]:
                raise RuntimeError(f"engine generated {out['meta_info']['completion_tokens']} tokens, "
                                   f"asked {req['max_new_tokens']}")
            return seconds, out["output_ids"]

        # open the connections first, so connection setup is not inside the timing
        await asyncio.gather(*(client.get("/health") for _ in workload))
        start = time.perf_counter()
        results = await asyncio.gather(*(one(req) for req in workload))
        wall = time.perf_counter() - start
    return wall, [s for s, _ in results], [ids for _, ids in results]


def engine_round(url: str, pid: int, workload: list[dict]) -> dict:
    cpu0 = proc_cpu_seconds(pid)
    wall, latencies, outputs = asyncio.run(_engine_round(url, workload))
    return {"wall_s": wall, "latencies_s": latencies, "outputs": outputs,
            "engine_cpu_s": proc_cpu_seconds(pid) - cpu0}


# ---------------------------------------------------------------------------------- transformers


def hf_generate(model, requests: list[dict], pad_id: int) -> tuple[float, list[list[int]]]:
    """One left-padded greedy batch, max_new_tokens = the longest request, EOS off."""
    longest_prompt = max(len(r["prompt"]) for r in requests)
    max_new = max(r["max_new_tokens"] for r in requests)
    ids = torch.full((len(requests), longest_prompt), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, longest_prompt - len(r["prompt"]):] = torch.tensor(r["prompt"])
        mask[i, longest_prompt - len(r["prompt"]):] = 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    generated = out[:, longest_prompt:]
    if generated.shape[1] != max_new:
        raise RuntimeError(f"generate produced {generated.shape[1]} new tokens, asked {max_new}")
    return seconds, [generated[i, :r["max_new_tokens"]].tolist() for i, r in enumerate(requests)]


def hf_batched_round(model, workload: list[dict], pad_id: int) -> dict:
    wall, outputs = hf_generate(model, workload, pad_id)
    return {"wall_s": wall, "latencies_s": [wall] * len(workload), "outputs": outputs}


def hf_bucketed_round(model, workload: list[dict], pad_id: int) -> dict:
    buckets = [[i for i, r in enumerate(workload) if r["max_new_tokens"] <= SHORT_MAX],
               [i for i, r in enumerate(workload) if r["max_new_tokens"] > SHORT_MAX]]
    latencies = [0.0] * len(workload)
    elapsed = 0.0
    for bucket in buckets:
        if not bucket:
            continue
        seconds, _ = hf_generate(model, [workload[i] for i in bucket], pad_id)
        elapsed += seconds
        for i in bucket:
            latencies[i] = elapsed
    return {"wall_s": elapsed, "latencies_s": latencies}


# ---------------------------------------------------------------------------------- summaries


def summarize(runs: list[dict], useful_tokens: int, computed_tokens: int | None = None) -> dict:
    walls = [r["wall_s"] for r in runs]
    median = statistics.median(walls)
    # latency percentiles are those of the repetition with the median wall time
    mid = runs[sorted(range(len(runs)), key=lambda i: walls[i])[len(runs) // 2]]
    out = {"wall_s": round(median, 3), "useful_tokens_per_s": round(useful_tokens / median, 1),
           "latency": percentiles(mid["latencies_s"]), "runs_wall_s": [round(w, 3) for w in walls]}
    if computed_tokens is not None:
        out["computed_tokens"] = computed_tokens
        out["computed_tokens_per_s"] = round(computed_tokens / median, 1)
    if "engine_cpu_s" in runs[0]:
        cpu = statistics.median(r["engine_cpu_s"] for r in runs)
        out["engine_cpu_s"] = round(cpu, 3)
        out["engine_cpu_busy_fraction"] = round(cpu / median, 3)
    return out


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k / max(1, len(x)))
    return {"identical_requests": same, "of": len(a), "mean_common_prefix_fraction": round(float(np.mean(prefix)), 3)}


# ---------------------------------------------------------------------------------- in-process profile


def profile_engine(model, tokenizer, workload: list[dict], top: int = 25) -> dict:
    """The engine's Scheduler + RaggedDecoder in this process (no HTTP, no engine thread), stepped
    by hand under cProfile until every request finishes."""
    import cProfile
    import io
    import pstats

    from services.model.ragged_decoder import RaggedDecoder
    from services.rollout.engine.sampling import SamplingParams
    from services.rollout.engine.scheduler import Scheduler, Sequence

    def run() -> tuple[float, int]:
        sched = Scheduler(RaggedDecoder(model), tokenizer)
        seqs = [Sequence(rid=f"p{i}", prompt=list(r["prompt"]), on_update=lambda s: None,
                         params=SamplingParams(max_new_tokens=r["max_new_tokens"], temperature=0, ignore_eos=True))
                for i, r in enumerate(workload)]
        for s in seqs:
            sched.submit(s)
        start = time.perf_counter()
        while sched.waiting or sched.running:
            sched._step()
        seconds = time.perf_counter() - start
        assert all(len(s.output) == r["max_new_tokens"] for s, r in zip(seqs, workload))
        return seconds, sched.steps

    run()  # warm-up
    plain_s, steps = run()
    profiler = cProfile.Profile()
    profiler.enable()
    profiled_s, _ = run()
    profiler.disable()

    def table(sort: str) -> list[dict]:
        stats = pstats.Stats(profiler, stream=io.StringIO())
        stats.sort_stats(sort)
        rows = []
        for func in stats.fcn_list[:top]:
            _, calls, own, cum, _ = stats.stats[func]
            where = os.path.relpath(func[0]) if func[0].startswith("/") else func[0]
            rows.append({"function": f"{where}:{func[1]}({func[2]})", "calls": calls, "own_s": round(own, 3),
                         "cum_s": round(cum, 3)})
        return rows

    useful = sum(r["max_new_tokens"] for r in workload)
    return {"in_process_wall_s": round(plain_s, 3), "in_process_tokens_per_s": round(useful / plain_s, 1),
            "steps": steps, "ms_per_step": round(plain_s / steps * 1e3, 2),
            "profiled_wall_s": round(profiled_s, 3), "top_cumulative": table("cumulative"), "top_own": table("tottime")}


# ---------------------------------------------------------------------------------- main


def run_benchmark(args) -> dict:
    torch.set_num_threads(1)
    n = args.prompts or (16 if args.quick else 64)
    preset = args.preset or ("tiny" if args.quick else "small")
    long_factor = 4 if args.quick else 8
    reps = args.reps or (2 if args.quick else 5)
    log_dir = tempfile.mkdtemp(prefix="sluice-engine-bench-")
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = init_model(os.path.join(log_dir, f"model-{preset}"), preset=preset, arch="qwen2", seed=0)
        log(f"wrote a random qwen2/{preset} model to {model_dir}")
    model, tokenizer = load_causal_lm(model_dir)
    params = sum(p.numel() for p in model.parameters())
    special = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    special |= set(tokenizer.all_special_ids)
    workload = make_workload(n, model.config.vocab_size, special, long_factor, seed=args.seed)
    useful = sum(r["max_new_tokens"] for r in workload)
    lengths = [r["max_new_tokens"] for r in workload]
    log(f"{n} requests, {useful} output tokens (max {max(lengths)}), {params / 1e6:.2f}M params; "
        f"{reps} reps + 1 warm-up; logs in {log_dir}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    proc, url = start_engine(model_dir, log_dir)
    log(f"engine ready at {url} (pid {proc.proc.pid})")
    engine_runs, batched_runs, bucketed_runs = [], [], []
    try:
        for rep in range(reps + 1):
            tag = "warm-up" if rep == 0 else f"rep {rep}/{reps}"
            e = engine_round(url, proc.proc.pid, workload)
            log(f"{tag}: engine {e['wall_s']:.2f}s ({useful / e['wall_s']:.0f} tok/s, "
                f"engine cpu {e['engine_cpu_s']:.2f}s)")
            b = hf_batched_round(model, workload, pad_id)
            log(f"{tag}: hf batched {b['wall_s']:.2f}s ({useful / b['wall_s']:.0f} useful tok/s)")
            k = hf_bucketed_round(model, workload, pad_id) if not args.no_bucketed else None
            if k:
                log(f"{tag}: hf bucketed {k['wall_s']:.2f}s ({useful / k['wall_s']:.0f} useful tok/s)")
            if rep > 0:
                engine_runs.append(e)
                batched_runs.append(b)
                if k:
                    bucketed_runs.append(k)
    finally:
        proc.stop()

    result = {
        "benchmark": "engine_throughput",
        "config": {"quick": args.quick, "prompts": n, "preset": preset, "arch": "qwen2", "params": params,
                   "dtype": "float32", "reps": reps, "seed": args.seed,
                   "prompt_tokens": {"min": min(len(r["prompt"]) for r in workload),
                                     "max": max(len(r["prompt"]) for r in workload),
                                     "total": sum(len(r["prompt"]) for r in workload)},
                   "output_tokens": {"min": min(lengths), "p50": int(statistics.median(lengths)), "max": max(lengths),
                                     "total": useful, "long_requests": sum(m > SHORT_MAX for m in lengths)},
                   "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                   "python": platform.python_version(), "torch": torch.__version__,
                   "transformers": __import__("transformers").__version__},
        "engine": summarize(engine_runs, useful),
        "hf_batched": summarize(batched_runs, useful, computed_tokens=n * max(lengths)),
    }
    if bucketed_runs:
        short = [m for m in lengths if m <= SHORT_MAX]
        long_ = [m for m in lengths if m > SHORT_MAX]
        computed = len(short) * max(short, default=0) + len(long_) * max(long_, default=0)
        result["hf_bucketed"] = summarize(bucketed_runs, useful, computed_tokens=computed)
    result["greedy_agreement_engine_vs_hf_batched"] = greedy_agreement(engine_runs[-1]["outputs"],
                                                                       batched_runs[-1]["outputs"])
    ratio = result["engine"]["useful_tokens_per_s"] / result["hf_batched"]["useful_tokens_per_s"]
    result["ratio_vs_hf_batched"] = round(ratio, 3)
    if bucketed_runs:
        result["ratio_vs_hf_bucketed"] = round(
            result["engine"]["useful_tokens_per_s"] / result["hf_bucketed"]["useful_tokens_per_s"], 3)
    result["target"] = {"ratio_vs_hf_batched_min": TARGET_RATIO, "met": ratio >= TARGET_RATIO}
    if args.profile:
        log("profiling the engine's scheduler in-process")
        result["engine_in_process_profile"] = profile_engine(model, tokenizer, workload)
    result["runtime_s"] = round(time.perf_counter() - _T0, 1)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 16 prompts, tiny preset, outputs up to 128")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; 2 with --quick)")
    p.add_argument("--prompts", type=int, default=None, help="number of requests (default 64; 16 with --quick)")
    p.add_argument("--preset", choices=["tiny", "small"], default=None,
                   help="model preset (default small; tiny with --quick)")
    p.add_argument("--model-dir", default=None, help="use this model directory instead of writing a fresh one")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--no-bucketed", action="store_true", help="skip the per-length-bucket transformers variant")
    p.add_argument("--profile", action="store_true", help="also cProfile the engine's scheduler in-process")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(json.dumps(run_benchmark(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
