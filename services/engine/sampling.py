"""Sampling parameters (SGLang's names and defaults) and the token sampler.

Log-probs reported for a token are log_softmax of the model's raw logits at that position (the
distribution a teacher-forced forward pass of the same weights gives), whatever the temperature or
truncation used to pick it."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

GREEDY_BELOW = 1e-6


class SamplingParams(BaseModel):
    # JSON as Python parses it has NaN and Infinity: no sampler setting may be either
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # sampled rows carry top_k in an int64 tensor: a larger value would fail the engine's step (and stop the
    # engine); anything past the vocabulary already means all of it
    top_k: int = Field(-1, le=(1 << 63) - 1, description="-1 = the whole vocabulary")
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = Field(None, ge=0, le=(1 << 63) - 1, description="a torch.Generator seed (the "
                                      "n samples take seed, seed + 1, ...)")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (no limit) or positive")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _truncate(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after per-row top-k, min-p and top-p (rows whose setting is off are untouched)."""
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, scores.shape[-1]).clamp(max=scores.shape[-1])
        kth = torch.topk(scores, int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0)
    if bool((top_p < 1).any()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cut = sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None]  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(cut, 0))
    return probs


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 banned: list[list[int]]) -> tuple[list[int], list[float], torch.Tensor]:
    """One token per row of `logits` [rows, vocab]: greedy rows take the argmax, the others sample from
    softmax(logits / T) truncated by their own top-k, min-p and top-p. `banned[i]` (EOS before
    min_new_tokens) can never be picked. A row with a generator (a request's `sampling_seed`) draws from it
    alone, so its sample does not depend on the rest of the batch; the others share one batched draw.

    Returns the tokens, their log-probs, and per row the log-probs over the vocabulary of the temperature-scaled
    distribution,
    log_softmax(logits / T), before truncation (raw logits when greedy): what SGLang reports and what a
    trainer recomputes from logits / T."""
    scores = logits.float()
    greedy = [p.temperature < GREEDY_BELOW for p in params]
    if not all(greedy):  # an all-greedy batch (evaluation) skips the division
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=scores.device)
        scores = scores / temps[:, None]
    logprobs = torch.log_softmax(scores, dim=-1)
    bans = [(i, t) for i, row in enumerate(banned) for t in row]
    if bans:
        rows, cols = zip(*bans)
        at = (torch.tensor(rows, device=scores.device), torch.tensor(cols, device=scores.device))
        scores = scores.index_put(at, torch.tensor(float("-inf"), device=scores.device))
    tokens = scores.argmax(dim=-1)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        index = torch.tensor(sampled, device=scores.device)
        device = scores.device
        probs = _truncate(scores[index], torch.tensor([params[i].top_k for i in sampled], device=device),
                          torch.tensor([params[i].top_p for i in sampled], device=device),
                          torch.tensor([params[i].min_p for i in sampled], device=device))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        shared = [k for k, i in enumerate(sampled) if generators[i] is None]
        if shared:
            tokens[index[shared]] = torch.multinomial(probs[shared], 1)[:, 0]
        for k, i in enumerate(sampled):
            if generators[i] is not None:
                tokens[i] = torch.multinomial(probs[k], 1, generator=generators[i])[0]
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist(), logprobs
