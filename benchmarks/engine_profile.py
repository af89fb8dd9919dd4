"""The built-in engine's Scheduler + BatchedDecoder run in the benchmark's own process (no HTTP, no engine
thread) on a workload, stepped by hand: a plain timed run and a cProfile run (`engine_throughput.py --profile`)."""

from __future__ import annotations

import os
import time


def _in_process_engine(model, tokenizer):
    """The engine's KV pool, decoder and scheduler factory, built as `sluice engine` builds them (server.py)."""
    from services.engine.batched_decoder import BatchedDecoder
    from services.engine.config import EngineConfig
    from services.engine.server import make_pool, make_scheduler

    config = EngineConfig(model="(in-process)")
    decoder = BatchedDecoder(model, make_pool(model, config))
    return lambda: make_scheduler(decoder, tokenizer, config)


def _scheduler_run(new_scheduler, workload: list[dict]) -> tuple[float, int]:
    """Submit the whole workload to a fresh Scheduler, grouped as server.py groups a /generate batch, and
    step it by hand until nothing is left."""
    from services.engine.request import Generation, share_prompts
    from services.engine.sampling import SamplingParams

    sched = new_scheduler()
    gens = [
        Generation(
            rid=f"p{i}",
            prompt=list(r["prompt"]),
            on_update=lambda g: None,
            params=SamplingParams(max_new_tokens=r["max_new_tokens"], temperature=0, ignore_eos=True),
        )
        for i, r in enumerate(workload)
    ]
    start = time.perf_counter()
    for group in share_prompts(gens):
        sched.submit(group)
    while sched.waiting or sched.running:
        sched.step()
    seconds = time.perf_counter() - start
    for gen, r in zip(gens, workload):
        if len(gen.output) != r["max_new_tokens"]:
            raise RuntimeError(f"in-process engine generated {len(gen.output)} tokens, asked {r['max_new_tokens']}")
    return seconds, sched.steps


def _top_functions(profiler, sort: str, top: int) -> list[dict]:
    import io
    import pstats

    stats = pstats.Stats(profiler, stream=io.StringIO())
    stats.sort_stats(sort)
    rows = []
    for func in stats.fcn_list[:top]:
        _, calls, own, cum, _ = stats.stats[func]
        where = os.path.relpath(func[0]) if func[0].startswith("/") else func[0]
        rows.append(
            {
                "function": f"{where}:{func[1]}({func[2]})",
                "calls": calls,
                "own_s": round(own, 3),
                "cum_s": round(cum, 3),
            }
        )
    return rows


def profile_engine(model, tokenizer, workload: list[dict], top: int = 25) -> dict:
    """One warm-up run, one plain timed run, one run under cProfile, all in this process."""
    import cProfile

    new_scheduler = _in_process_engine(model, tokenizer)
    _scheduler_run(new_scheduler, workload)  # warm-up
    plain_s, steps = _scheduler_run(new_scheduler, workload)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled_s, _ = _scheduler_run(new_scheduler, workload)
    profiler.disable()
    useful = sum(r["max_new_tokens"] for r in workload)
    return {
        "in_process_wall_s": round(plain_s, 3),
        "in_process_tokens_per_s": round(useful / plain_s, 1),
        "steps": steps,
        "ms_per_step": round(plain_s / steps * 1e3, 2),
        "profiled_wall_s": round(profiled_s, 3),
        "top_cumulative": _top_functions(profiler, "cumulative", top),
        "top_own": _top_functions(profiler, "tottime", top),
    }


# ---------------------------------------------------------------------------------- main
