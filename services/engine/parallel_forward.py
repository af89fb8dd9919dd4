"""A step's forward over several CPU threads: `--forward-workers W` for an engine with W cores to itself.

Three ways to run one step, and which is fastest depends on the step, the model and the machine:
- **one**: the step as it is on one thread (the engine's own intra-op threads): a tiny model's step is all
  Python and dispatch, which more threads only slow down;
- **split**: the step's *sequences* in W sub-batches, balanced by token count, each run by the same
  `BatchedDecoder.forward` on its own thread with one intra-op thread (torch releases the GIL inside every
  kernel). Each thread gets whole kernels, so it wins where the kernels are long: a prefill step.
- **whole**: the step as it is, on W intra-op threads: every kernel shares the work. It wins where a step is
  hundreds of short kernels, whose GIL hand-offs between two Python threads cost more than they overlap.
Measured here (AMD EPYC, 2 vCPUs, the small preset, medians of 25; one thread / whole on 2 / split in 2):
a prefill of 64 prompts 251 / 141 / 125 ms; a decode step of 64 sequences x 2 tokens 17.1 / 11.3 / 17.2 ms;
a long-tail step of 6 x 9 tokens 8.4 / 5.8 / 11.5 ms. An earlier VM measured the 64 x 2 decode step the other
way round (split 12.0 ms against 17.2 whole on one thread; two intra-op threads gained ~6%); with the tiny
preset two threads made the whole round slower than one. So `StrategyChooser` measures the ways on the live
steps, per kind of step (prefill or decode, the step's token count to a power of two, splittable or not), runs
each kind the fastest way and tries another now and then. A step too narrow to split (fewer than
MIN_SPLIT_TOKENS tokens or MIN_SPLIT_SEQS sequences) runs one or whole.

Why this is safe: sub-batches touch disjoint slots of the KV pool and disjoint entries of `pool.lengths`; the
weights are only read during a forward, and weight loads, pauses and aborts run on the engine thread between
steps (scheduler.py), never during one. The outputs are the whole step's, in the same order, either way.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Protocol

import torch

from services.engine.batched_decoder import SHORT_INPUT, BatchedDecoder

# a step with fewer tokens or sequences than this runs whole (see the module doc)
MIN_SPLIT_TOKENS = 64
MIN_SPLIT_SEQS = 8


class StepStrategy(Protocol):
    """Which of `ways` a step of `kind` runs ("one", "whole" or "split"), and how long each took."""

    def pick(self, kind: tuple, ways: tuple[str, ...]) -> str: ...

    def record(self, kind: tuple, how: str, seconds_per_token: float) -> None: ...


class StrategyChooser:
    """Per kind of step, the way with the lowest moving average of seconds per token.

    A new kind tries the ways in the order the caller lists them (its prior: likeliest fastest first), once
    each, and stops trying as soon as a way is slower than one before it: the prior's order held there, so
    the ways after it are expected slower still (a step that splits well has kernels long enough for two
    intra-op threads to beat one). Ways not tried then, like every way but the fastest, are run on every
    EXPLORE_EVERY-th step of the kind, in turn (machines and loads change); a single noisy try is corrected by
    those steps' moving average.

    Why: a kind of prompt step comes once or twice per batch of requests, so with two tries of each way in
    alphabetical order (as before) the 64-request benchmark's first six rounds ran their 2,048-token
    prefill one, split, whole, one, split, whole, and one thread took 120 us a token there against 64 split
    (small preset, a 2-vCPU VM): a third of the engine's round lost in two rounds of six."""

    EXPLORE_EVERY, ALPHA = 16, 0.3

    def __init__(self):
        self._seen: dict[tuple, dict[str, list]] = {}  # kind -> way -> [average s/token, runs]
        self._count: dict[tuple, int] = {}

    def pick(self, kind: tuple, ways: tuple[str, ...]) -> str:
        seen = self._seen.setdefault(kind, {})
        stats = [seen.setdefault(w, [0.0, 0]) for w in ways]
        self._count[kind] = n = self._count.get(kind, 0) + 1
        k = next((i for i, st in enumerate(stats) if not st[1]), len(ways))  # ways[:k] tried, in order
        if (
            k < len(ways)
            and not any(st[1] for st in stats[k:])
            and (k == 0 or stats[k - 1][0] <= min(st[0] for st in stats[:k]))
        ):
            return ways[k]  # warming up: the prior's order has not held yet
        ranked = [
            w
            for *_, w in sorted((st[0] if st[1] else float("inf"), i, w) for i, (st, w) in enumerate(zip(stats, ways)))
        ]
        if n % self.EXPLORE_EVERY == 0:
            return ranked[1 + (n // self.EXPLORE_EVERY) % (len(ranked) - 1)]
        return ranked[0]

    def record(self, kind: tuple, how: str, seconds_per_token: float) -> None:
        seen = self._seen.setdefault(kind, {}).setdefault(how, [0.0, 0])
        seen[0] = seconds_per_token if not seen[1] else (1 - self.ALPHA) * seen[0] + self.ALPHA * seconds_per_token
        seen[1] += 1


def step_kind(lengths: list[int]) -> tuple:
    """(has a prompt chunk, token count's power of two, sequence count's power of two): steps of one kind cost
    about the same per token. The sequence count matters as much as the tokens: a step of 24 tokens over 24
    sequences and one over 3 sequences with 7 drafts each differ ~2x per token, and a long-tail round moves
    from the one to the other, so without it each way was measured in a different phase of the round."""
    return max(lengths) > SHORT_INPUT, sum(lengths).bit_length(), len(lengths).bit_length()


class ParallelForward:
    """`BatchedDecoder.forward` on `workers` threads (the scheduler's decoder when W > 1)."""

    def __init__(self, decoder: BatchedDecoder, workers: int, strategy: StepStrategy | None = None):
        if workers < 2:
            raise ValueError("ParallelForward needs at least two workers (one runs the decoder as it is)")
        self.decoder = decoder
        self.pool = decoder.pool
        self.workers = workers
        self.strategy = strategy or StrategyChooser()
        self._executor = ThreadPoolExecutor(workers - 1, thread_name_prefix="engine-forward")

    def forward(
        self, slots: list[int], new_tokens: list[list[int]], full_logits: list[bool] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As `BatchedDecoder.forward`: last-token logits `[len(slots), vocab]` and the full logits asked for."""
        lengths = [len(t) for t in new_tokens]
        cuts = split_points(lengths, self.workers)
        kind = (*step_kind(lengths), bool(cuts))
        # the prior order: sub-batches on their own cores first where the step splits, one thread last
        how = self.strategy.pick(kind, ("split", "whole", "one") if cuts else ("whole", "one"))
        began = time.perf_counter()
        if how == "split":
            out = self._split(slots, new_tokens, full_logits, cuts)
        elif how == "whole":
            out = self._whole(slots, new_tokens, full_logits)
        else:
            out = self.decoder.forward(slots, new_tokens, full_logits)
        self.strategy.record(kind, how, (time.perf_counter() - began) / sum(lengths))
        return out

    def _split(self, slots, new_tokens, full_logits, cuts):
        bounds = list(zip([0, *cuts], [*cuts, len(slots)]))
        futures = [
            self._executor.submit(
                self.decoder.forward, slots[a:b], new_tokens[a:b], full_logits[a:b] if full_logits else None
            )
            for a, b in bounds[1:]
        ]
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
    cuts: list[int] = []
    seen = 0
    for i, n in enumerate(lengths[:-1]):
        seen += n
        # cut after sequence i once this part holds its share of the tokens, leaving one sequence per part to go
        if seen * workers >= total * (len(cuts) + 1) and len(lengths) - (i + 1) >= workers - len(cuts) - 1:
            cuts.append(i + 1)
            if len(cuts) == workers - 1:
                break
    return cuts
