"""Dynamic sampling in the rollout (services/algorithms/group_filter.py has the rule): which scored groups are
written, and the cap that fails a run whose rewards hardly ever vary instead of letting it generate for ever.

A step needs `G` (rollout_batch_size) kept groups; with `f` of its groups filtered, the share filtered is
f / (f + G) once the step is written. The run fails when that share would exceed max_filter_ratio `r`:

    f / (f + G) > r   <=>   f > G r / (1 - r)

(G = 8, r = 0.9: the 73rd filtered group of one step fails the run)."""

from __future__ import annotations

import math
from typing import Sequence

from prometheus_client import Counter

from services.algorithms.group_filter import keeps_group, reward_std

FILTERED = Counter("sluice_rollout_filtered_groups_total", "groups dynamic sampling dropped (rollout.filter_groups)")


class FilteredTooMuch(RuntimeError):
    """More of one step's groups were filtered than max_filter_ratio allows."""


class GroupFiltering:
    def __init__(self, spec: str, max_ratio: float, groups_per_step: int):
        self.spec = spec
        self.max_ratio = max_ratio
        self.limit = math.floor(groups_per_step * max_ratio / (1 - max_ratio))
        self.groups_per_step = groups_per_step
        self.filtered_groups = 0  # by this process

    def keeps(self, rewards: Sequence[float]) -> bool:
        return keeps_group(rewards, self.spec)

    def reason(self, rewards: Sequence[float]) -> str:
        """What the ledger records for a filtered group."""
        return f"filter_groups {self.spec}: reward std {reward_std(rewards):.4g}"

    def counted(self, step: int, filtered_in_step: int) -> None:
        """A group of `step` was filtered, the step's `filtered_in_step`-th: FilteredTooMuch past the cap."""
        self.filtered_groups += 1
        FILTERED.inc()
        if filtered_in_step > self.limit:
            raise FilteredTooMuch(
                f"{filtered_in_step} groups of step {step} were filtered by filter_groups {self.spec} for "
                f"{self.groups_per_step} it needs (max_filter_ratio {self.max_ratio}): the rewards hardly vary "
                "between samples of a prompt; check the reward, or raise max_filter_ratio / loosen filter_groups"
            )
