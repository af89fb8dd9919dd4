"""Timeouts and retries of a reward computed by another service (an HTTP scorer, a judge model): one policy, so
every remote reward fails the same way.

Each attempt has `timeout_s` in all. An attempt that times out or raises Transient is tried again, up to
`retries` more times, after an exponential backoff (backoff_s, 2*backoff_s, ... capped at max_backoff_s, each
scaled by a random 0.5-1.0 so that many rollouts hitting one failing service do not retry in lockstep). A
RewardError from an attempt (the request's own fault: a 4xx, an answer that makes no reward) is not retried.
After the last attempt: RewardError, of kind "timeout" when that attempt timed out, else "exception"."""

from __future__ import annotations

import asyncio
import random
from typing import Awaitable, Callable, TypeVar

from services.rollout.rewards.errors import RewardError

T = TypeVar("T")


class Transient(Exception):
    """An attempt failed in a way that another attempt may not (a connection error, a 5xx)."""


async def with_retries(
    attempt: Callable[[], Awaitable[T]],
    what: str,
    *,
    timeout_s: float,
    retries: int,
    backoff_s: float = 0.25,
    max_backoff_s: float = 8.0,
) -> T:
    """attempt()'s result; `what` names the service in the final error ("reward endpoint https://...")."""
    attempts = retries + 1
    last_failure, timed_out = "", False
    for n in range(attempts):
        if n:
            delay = min(max_backoff_s, backoff_s * 2 ** (n - 1))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        try:
            # a client's own timeouts are per phase (connect, each read...); this bounds the whole attempt
            async with asyncio.timeout(timeout_s):
                return await attempt()
        except TimeoutError:
            last_failure, timed_out = f"no answer within {timeout_s}s", True
        except Transient as e:
            last_failure, timed_out = str(e), False
    raise RewardError(
        f"{what} failed {attempts} time(s); last: {last_failure}", "timeout" if timed_out else "exception"
    )


def check_limits(timeout_s: float, retries: int) -> None:
    """ValueError unless timeout_s > 0 and retries is an int >= 0."""
    if not timeout_s > 0:
        raise ValueError(f"reward timeout_s must be > 0, got {timeout_s!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"reward retries must be an int >= 0, got {retries!r}")
