"""A step's forward split over several CPU threads: `--forward-workers W` for an engine with W cores to itself.

On CPU, torch's own intra-op threads barely help the engine: a decode step of a small model is hundreds of
small kernels (matmuls of tens of rows, batched attention of a few rows per sequence), each too short to pay
for waking and joining a thread team. Splitting the step's *sequences* instead gives each thread whole
kernels: W sub-batches, balanced by token count, run the same `BatchedDecoder.forward` at once on disjoint
KV slots (torch releases the GIL inside every kernel), one intra-op thread each. Measured on a 2-core CPU
(the `engine_throughput.py` small workload, in-process scheduler, medians of 7, see docs/performance.md):
a 64-sequence decode step with two tokens each took 12.0 ms split in two against 17.2 ms whole, while two
intra-op threads gain ~6%.

A step too narrow to split well (the long tail of a batch: a handful of sequences, each reading every weight)
runs whole with W intra-op threads instead: there the matmuls are bound by reading the weights, and two
threads share that read.

Why this is safe: sub-batches touch disjoint slots of the KV pool and disjoint entries of `pool.lengths`; the
weights are only read during a forward, and weight loads, pauses and aborts run on the engine thread between
steps (scheduler.py), never during one. The outputs are the whole step's, in the same order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import torch

from services.model.batched_decoder import BatchedDecoder

# a step with fewer tokens or sequences than this runs whole (see the module doc)
MIN_SPLIT_TOKENS = 64
MIN_SPLIT_SEQS = 8


class ParallelForward:
    """`BatchedDecoder.forward`, split over `workers` threads (the scheduler's decoder when W > 1)."""

    def __init__(self, decoder: BatchedDecoder, workers: int):
        if workers < 2:
            raise ValueError("ParallelForward needs at least two workers (one runs the decoder as it is)")
        self.decoder = decoder
        self.pool = decoder.pool
        self.workers = workers
        self._executor = ThreadPoolExecutor(workers - 1, thread_name_prefix="engine-forward")

    def forward(self, slots: list[int], new_tokens: list[list[int]],
                full_logits: list[bool] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As `BatchedDecoder.forward`: last-token logits `[len(slots), vocab]` and the full logits asked for."""
        cuts = split_points([len(t) for t in new_tokens], self.workers)
        if not cuts:
            return self._whole(slots, new_tokens, full_logits)
        bounds = list(zip([0, *cuts], [*cuts, len(slots)]))
        futures = [self._executor.submit(self.decoder.forward, slots[a:b], new_tokens[a:b],
                                         full_logits[a:b] if full_logits else None) for a, b in bounds[1:]]
        a, b = bounds[0]
        try:
            first = self.decoder.forward(slots[a:b], new_tokens[a:b], full_logits[a:b] if full_logits else None)
        finally:  # every part ends before the step does, even when this one raised
            wait(futures)
        parts = [first, *(f.result() for f in futures)]  # a sub-batch's error is raised here
        full: dict[int, torch.Tensor] = {}
        for (start, _), (_, part_full) in zip(bounds, parts):
            full.update({start + i: rows for i, rows in part_full.items()})
        return torch.cat([logits for logits, _ in parts]), full

    def _whole(self, slots, new_tokens, full_logits):
        threads = torch.get_num_threads()
        torch.set_num_threads(self.workers)
        try:
            return self.decoder.forward(slots, new_tokens, full_logits)
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def split_points(lengths: list[int], workers: int) -> list[int]:
    """Where to cut a step's sequences into `workers` runs of about equal token counts (indices into
    `lengths`, each part non-empty), or [] when the step is too narrow to split."""
    total = sum(lengths)
    if workers < 2 or total < MIN_SPLIT_TOKENS or len(lengths) < max(MIN_SPLIT_SEQS, workers):
        return []
    cuts, seen = [], 0
    for i, n in enumerate(lengths[:-1]):
        seen += n
        # cut after sequence i once this part holds its share of the tokens, leaving one sequence per part to go
        if seen * workers >= total * (len(cuts) + 1) and len(lengths) - (i + 1) >= workers - len(cuts) - 1:
            cuts.append(i + 1)
            if len(cuts) == workers - 1:
                break
    return cuts
