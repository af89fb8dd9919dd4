"""Hugging Face transformers baselines of benchmarks/engine_throughput.py, all in the calling process on its
model, on that model's device and dtype (CPU float32 by default): `generate` as one padded batch, `generate`
per output-length bucket (with its default dynamic KV cache, or a static one), transformers' own continuous
batching manager, and the unpadded per-request greedy reference (batch of 1, not timed).

The continuous batching manager runs on its own copy of the model: transformers switches the attention of the
model it is given to a paged one for as long as the manager lives (5.17: `sdpa` -> `paged|sdpa`, which refuses
a plain forward: "paged|sdpa was called without a paged attention cache"), and the baselines take turns in
every repetition, so `generate` must never see that model."""

from __future__ import annotations

import copy
import inspect
import math
import time

import torch

SHORT_MAX = 32  # bucket boundary for hf_bucketed; the short outputs are in [16, 32]


# ---------------------------------------------------------------------------------- generate


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so a wall time covers them (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model, requests: list[dict], pad_id: int, cache: str | None = None) -> tuple[float, list[list[int]]]:
    """One left-padded greedy batch, max_new_tokens = the longest request, EOS off; cache: generate's
    cache_implementation (None: its default dynamic cache; "static": preallocated, which transformers also
    compiles on a GPU)."""
    longest_prompt = max(len(r["prompt"]) for r in requests)
    max_new = max(r["max_new_tokens"] for r in requests)
    ids = torch.full((len(requests), longest_prompt), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, longest_prompt - len(r["prompt"]) :] = torch.tensor(r["prompt"])
        mask[i, longest_prompt - len(r["prompt"]) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    synchronize(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
            **({"cache_implementation": cache} if cache else {}),
        )
    synchronize(model.device)
    seconds = time.perf_counter() - start
    generated = out[:, longest_prompt:]
    if generated.shape[1] != max_new:
        raise RuntimeError(f"generate produced {generated.shape[1]} new tokens, asked {max_new}")
    return seconds, [generated[i, : r["max_new_tokens"]].tolist() for i, r in enumerate(requests)]


def hf_batched_round(model, workload: list[dict], pad_id: int) -> dict:
    wall, outputs = hf_generate(model, workload, pad_id)
    return {"wall_s": wall, "latencies_s": [wall] * len(workload), "outputs": outputs}


def length_buckets(workload: list[dict]) -> list[list[int]]:
    """Request indices per output-length bucket: short (<= SHORT_MAX) first, then long."""
    return [
        [i for i, r in enumerate(workload) if r["max_new_tokens"] <= SHORT_MAX],
        [i for i, r in enumerate(workload) if r["max_new_tokens"] > SHORT_MAX],
    ]


def bucketed_computed_tokens(workload: list[dict]) -> int:
    """Tokens hf_bucketed computes: every row of a bucket runs to the bucket's longest request."""
    return sum(len(b) * max(workload[i]["max_new_tokens"] for i in b) for b in length_buckets(workload) if b)


def hf_bucketed_round(model, workload: list[dict], pad_id: int, cache: str | None = None) -> dict:
    latencies = [0.0] * len(workload)
    elapsed = 0.0
    for bucket in length_buckets(workload):
        if not bucket:
            continue
        seconds, _ = hf_generate(model, [workload[i] for i in bucket], pad_id, cache)
        elapsed += seconds
        for i in bucket:
            latencies[i] = elapsed
    return {"wall_s": elapsed, "latencies_s": latencies}


def hf_per_request_reference(model, workload: list[dict], pad_id: int) -> list[list[int]]:
    """Greedy output of each prompt alone (batch of 1, no padding), exactly its max_new_tokens, EOS off."""
    outputs = []
    with torch.no_grad():
        for r in workload:
            m = r["max_new_tokens"]
            ids = torch.tensor([r["prompt"]], device=model.device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=m,
                min_new_tokens=m,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
            generated = out[0, ids.shape[1] :].tolist()
            if len(generated) != m:
                raise RuntimeError(f"per-request generate produced {len(generated)} tokens, asked {m}")
            outputs.append(generated)
    return outputs


# ---------------------------------------------------------------------------------- continuous batching


class HFContinuousBatching:
    """transformers' ContinuousBatchingManager (`model.init_continuous_batching`) over its own copy of this
    process's model (the model given is left as it is: see the module's docstring), started once and fed one
    round of requests at a time. Each request is added with its own max_new_tokens
    and no EOS (eos_token_id -1), greedy. transformers sizes its paged KV cache from free device memory,
    which it cannot read on a CPU without psutil, so the cache is sized explicitly: enough pages of
    `page_size` (its default) tokens for every request of the workload at once, and at most
    `max_batch_tokens` tokens per step (the engine's default chunked_prefill_size)."""

    def __init__(self, model, workload: list[dict], max_batch_tokens: int = 2048):
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        defaults = ContinuousBatchingConfig()  # releases before 5.2x name the page size block_size
        page = getattr(defaults, "page_size", None) or getattr(defaults, "block_size", 256)
        num_blocks = sum(math.ceil((len(r["prompt"]) + r["max_new_tokens"]) / page) for r in workload) + 2
        options = {"num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens, "auto_switch_to_flash": False}
        accepted = inspect.signature(ContinuousBatchingConfig).parameters  # 5.17 has no auto_switch_to_flash
        cb_config = ContinuousBatchingConfig(**{k: v for k, v in options.items() if k in accepted})
        hints = WorkloadHints(
            max_prompt_length=max(len(r["prompt"]) for r in workload),
            max_generated_length=max(r["max_new_tokens"] for r in workload),
            num_requests=len(workload),
        )
        gen_config = GenerationConfig(
            do_sample=False, eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id
        )
        self.model = copy.deepcopy(model)  # transformers switches this copy's attention, never the shared model's
        self.manager = self.model.init_continuous_batching(
            generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
        )
        self.config = {
            "attn_implementation": self.model.config._attn_implementation,
            "page_size": page,
            "num_blocks": num_blocks,
            "max_batch_tokens": max_batch_tokens,
        }
        self.rounds = 0
        self.manager.warmup()
        self.manager.start()

    def round(self, workload: list[dict]) -> dict:
        self.rounds += 1
        ids = [f"r{self.rounds}-{i}" for i in range(len(workload))]
        index = {rid: i for i, rid in enumerate(ids)}
        latencies: list[float] = [0.0] * len(workload)
        outputs: list[list[int] | None] = [None] * len(workload)
        start = time.perf_counter()
        for rid, r in zip(ids, workload):
            self.manager.add_request(r["prompt"], request_id=rid, max_new_tokens=r["max_new_tokens"], eos_token_id=-1)
        left = len(workload)
        while left:
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    error = self.manager.background_thread_status.fatal_error
                    raise RuntimeError(f"continuous batching loop stopped: {error}")
                continue
            if not result.is_finished() or result.request_id not in index:
                continue
            if result.error is not None:
                raise RuntimeError(f"continuous batching request failed: {result.error}")
            i = index[result.request_id]
            latencies[i] = time.perf_counter() - start
            outputs[i] = list(result.generated_tokens)
            left -= 1
        wall = time.perf_counter() - start
        for out, r in zip(outputs, workload):
            if len(out) != r["max_new_tokens"]:
                raise RuntimeError(f"continuous batching generated {len(out)} tokens, asked {r['max_new_tokens']}")
        return {"wall_s": wall, "latencies_s": latencies, "outputs": outputs}

    def close(self) -> None:
        try:
            self.manager.stop(block=True, timeout=30)
        finally:
            self.manager.destroy()
            self.model = None  # the copy's memory goes back (a GPU's, where it runs)


def start_continuous_batching(model, workload: list[dict]) -> tuple[HFContinuousBatching | None, str | None]:
    """The running manager, or None and the error (type: message) that kept it from starting."""
    try:
        return HFContinuousBatching(model, workload), None
    except Exception as exc:  # reported in the benchmark's JSON instead
        return None, f"{type(exc).__name__}: {exc}"
