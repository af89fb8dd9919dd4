"""Reward functions named by import path in test_rewards.py (import:tests.rollout.reward_fixtures:NAME)."""

from __future__ import annotations

import asyncio
import threading

CALL_THREADS: list[int] = []  # the threads label_in_response ran in


def label_in_response(response, fields, prompt):
    """Sync: True when the label occurs in the response."""
    CALL_THREADS.append(threading.get_ident())
    fields["label"] = "changed"  # its own copy: must not leak into the record
    return prompt.startswith("What") and response.endswith("42")


async def prompt_length(response, fields, prompt):
    await asyncio.sleep(0)
    return len(prompt) / 100


async def slow_async(response, fields, prompt):
    await asyncio.sleep(60)
    return 1.0


def wrong_type(response, fields, prompt):
    return "high"


def not_finite(response, fields, prompt):
    return float("nan")


def raises(response, fields, prompt):
    raise KeyError("answer")


def two_args(response, fields):
    return 1.0


NOT_A_FUNCTION = 3
