"""The interface every reward implements, and the check every reward value passes."""

from __future__ import annotations

import abc
import math
import numbers

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards.errors import RewardError


class RewardFunction(abc.ABC):
    name: str = "reward"

    @abc.abstractmethod
    async def score(self, record: PromptRecord, response: str) -> float:
        """The reward for one response to record's prompt: a finite float, or RewardError."""

    async def aclose(self) -> None:  # noqa: B027 - a default, not an abstract method
        """Release what the function holds (connections); the default holds nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def finite_reward(value, source: str) -> float:
    """value as a float if it is a finite real number (bool counts as 0/1); else RewardError naming
    source and what came back."""
    if not isinstance(value, numbers.Real):  # int, float, bool, and numpy's scalars
        raise RewardError(f"{source} returned {type(value).__name__} ({_excerpt(value)}), expected a number")
    result = float(value)
    if not math.isfinite(result):
        raise RewardError(f"{source} returned {result}, expected a finite number")
    return result


def _excerpt(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
