"""Sampling parameters (SGLang's names and defaults) and the token sampler.

Log-probs reported for a token are log_softmax of the model's raw logits at that position (the
distribution a teacher-forced forward pass of the same weights gives), whatever the temperature or
truncation used to pick it."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

GREEDY_BELOW = 1e-6


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = the whole vocabulary")
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = None

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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           banned: list[int] = ()) -> tuple[int, torch.Tensor]:
    """-> (token id, log-probs over the vocabulary of the temperature-scaled distribution,
    log_softmax(logits / T), before top-k/top-p/min-p truncation; raw logits when greedy). This is what
    SGLang reports and what a trainer recomputes from logits / T."""
    scores = logits.float().clone()
    if params.temperature < GREEDY_BELOW:
        logprobs = torch.log_softmax(scores, dim=-1)
        if banned:
            scores[list(banned)] = float("-inf")
        return int(scores.argmax()), logprobs
    scores = scores / params.temperature
    logprobs = torch.log_softmax(scores, dim=-1)
    if banned:
        scores[list(banned)] = float("-inf")
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores[scores < kth] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        probs[probs < params.min_p * probs.max()] = 0
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(0)
        cut = cumulative - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        sorted_probs[cut] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator)), logprobs
