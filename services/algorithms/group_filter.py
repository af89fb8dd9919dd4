"""Dynamic sampling (DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
section 3.2): a prompt group whose samples all got the same reward has zero group-normalised advantage,

    A_i = (r_i - mean(r)) / std(r) = 0  for every i when r_1 = ... = r_n,

so it adds no policy gradient but takes a place in the batch; filtering such groups (and generating more
prompts in their place) keeps every step's batch of informative groups. `rollout.filter_groups`:

    none            keep every group
    zero_variance   drop a group whose rewards are all equal (DAPO's rule)
    std_below:X     drop a group whose rewards' population standard deviation is below X
                    (std = sqrt(mean((r_i - mean(r))^2)); X > 0; zero_variance is std_below with X -> 0)
"""

from __future__ import annotations

import math
import re
from typing import Sequence

FILTER_PATTERN = r"^(none|zero_variance|std_below:(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?)$"


def reward_std(rewards: Sequence[float]) -> float:
    """The population standard deviation of `rewards` (0 for fewer than two)."""
    if len(rewards) < 2:
        return 0.0
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def keeps_group(rewards: Sequence[float], spec: str) -> bool:
    """Whether a group with these rewards is trained under `spec` (one of the forms above). A group of one
    sample has no variance to speak of and is kept."""
    if not re.fullmatch(FILTER_PATTERN, spec):
        raise ValueError(f"filter_groups {spec!r}: expected none, zero_variance or std_below:<number>")
    if spec == "none" or len(rewards) < 2:
        return True
    if spec == "zero_variance":
        return any(r != rewards[0] for r in rewards)
    threshold = float(spec.split(":", 1)[1])
    if not threshold > 0:
        raise ValueError(f"filter_groups {spec!r}: the threshold must be > 0")
    return reward_std(rewards) >= threshold
