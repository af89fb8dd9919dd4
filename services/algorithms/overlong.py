"""Overlong handling (DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
section 3.4). An answer cut off at the length limit is not necessarily a wrong one; punishing it like one (or
training on its truncated tokens at all) adds reward noise.

Soft overlong punishment (DAPO eq. 13), with L_max = max_new_tokens, L_cache = the buffer and p the penalty
factor, added to the sample's reward:

    R_length(y) = 0                                  |y| <= L_max - L_cache
                = p ((L_max - L_cache) - |y|) / L_cache     L_max - L_cache < |y| <= L_max
                = -p                                 |y| > L_max

so the penalty grows linearly from 0 to p over the last L_cache tokens. Overlong filtering masks every token of
a truncated sample (one that hit the length limit rather than ending) out of the loss."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """R_length of a response of `length` tokens (<= 0)."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be in (0, max_length = {max_length}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"the overlong penalty must be >= 0, got {penalty}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length > max_length:
        return -penalty
    return penalty * (start - length) / buffer


def truncated(finish_reason: str) -> bool:
    """Whether a sample was cut off at its length limit (SGLang's finish reason "length") instead of ending."""
    return finish_reason == "length"
