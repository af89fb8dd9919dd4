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
    sampling_seed: int | None = Field(
        None, ge=0, le=(1 << 63) - 1, description="a torch.Generator seed (the n samples take seed, seed + 1, ...)"
    )
    # SGLang's other keys. Penalties and constrained decoding are not served: only their neutral values pass.
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="SGLang's: only 0 (not served)")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="SGLang's: only 0 (not served)")
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0, description="SGLang's: only 1 (not served)")
    regex: None = None
    json_schema: None = None
    ebnf: None = None
    structural_tag: None = None
    stop_regex: None = None
    logit_bias: None = None
    custom_params: None = None
    # text formatting and streaming cadence: accepted, with no effect on the tokens (the text is decoded without
    # special tokens and a matched stop string is trimmed; trainers read output_ids, which these never change)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = Field(None, ge=1)

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


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] (unnormalised, >= 0) by inverse transform sampling:

        token_i = min { j : sum_{v <= j} p_iv > u_i * sum_v p_iv },   u_i ~ U[0, 1)

    so token j is drawn with probability p_ij / sum_v p_iv, and a token of zero probability never is. One
    cumulative sum and one binary search for the whole batch, from one uniform per row. Why not
    `torch.multinomial`: on CPU it cost 35 us per row at a 1k vocabulary and 0.8 ms at 32k (measured here,
    one thread), and a seeded row needs a call of its own; in a fully-async run it was a third of the
    engine's CPU time."""
    cdf = probs.cumsum(dim=-1)
    if not bool(torch.isfinite(cdf[:, -1]).all()):  # NaN anywhere in a row reaches its total
        raise ValueError("sampling probabilities are NaN or infinite: the model's logits are not finite")
    ids = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    # float rounding can put u * total at or past the last cumulative sum, onto a token with no mass: such a
    # row takes its most likely token
    empty = probs.gather(-1, ids[:, None])[:, 0] <= 0
    if bool(empty.any()):
        ids = torch.where(empty, probs.argmax(dim=-1), ids)
    return ids


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
) -> tuple[list[int], list[float], torch.Tensor]:
    """One token per row of `logits` [rows, vocab]: greedy rows take the argmax, the others sample from
    softmax(logits / T) truncated by their own top-k, min-p and top-p. `banned[i]` (EOS before
    min_new_tokens) can never be picked. Sampled rows draw by `inverse_cdf`, one uniform each: a row with a
    generator (a request's `sampling_seed`) takes its uniform from it alone, so its sample does not depend on the
    rest of the batch; the others share one batched draw.

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
        probs = _truncate(
            scores[index],
            torch.tensor([params[i].top_k for i in sampled], device=device),
            torch.tensor([params[i].top_p for i in sampled], device=device),
            torch.tensor([params[i].min_p for i in sampled], device=device),
        )
        uniforms = torch.rand(len(sampled), device=device)  # one shared draw for the rows without a seed ...
        for k, i in enumerate(sampled):
            if generators[i] is not None:  # ... and a seeded row's own, from its generator alone
                uniforms[k] = torch.rand((), generator=generators[i], device=device)
        tokens[index] = inverse_cdf(probs, uniforms)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist(), logprobs
