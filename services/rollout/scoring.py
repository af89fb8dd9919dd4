"""Scoring a group's samples with the run's reward, and what happens when the user's reward fails.

Only a RewardError falls back (services/rollout/rewards: the user's function raised or returned a non-number,
the endpoint refused or timed out after its retries, the row lacks a field the reward reads); any other
exception is a bug in Sluice and propagates, failing the rollout loudly. `rollout.reward_fallback`:

    zero        a failing sample gets reward 0.0; the group is written
    skip_group  the whole group is dropped (score() returns None); the rollout gives its slot a spare prompt

A reward that fails on every sample of FAILED_GROUPS_LIMIT groups in a row is broken, not flaky: the rollout
fails (run status `failed`) rather than train a whole run on fallback rewards.

A group whose rewards all equal each other has zero variance: GRPO's advantages (r - mean) / std are all 0,
so it teaches nothing. Such groups are counted and logged (at the 1st, 2nd, 4th, 8th, ... one)."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal, Sequence

from prometheus_client import Counter

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards import RewardError, RewardFunction

log = logging.getLogger(__name__)
REWARD_FAILURES = Counter(
    "sluice_rollout_reward_failures_total",
    "samples whose reward failed (rollout.reward_fallback was applied), by reason",
    ["reason"],
)
ZERO_VARIANCE = Counter(
    "sluice_rollout_zero_variance_groups_total",
    "groups written whose samples all got the same reward (GRPO learns nothing from them)",
)
SKIPPED_GROUPS = Counter(
    "sluice_rollout_skipped_groups_total", "groups dropped because their reward failed (reward_fallback skip_group)"
)
for _reason in ("exception", "timeout"):  # both series exist (at 0) from the start
    REWARD_FAILURES.labels(reason=_reason)
FAILED_GROUPS_LIMIT = 8
ERROR_CHARS = 500  # of a failure's message in a log line or a skip record


class RewardBroken(RuntimeError):
    """The reward failed on every sample of FAILED_GROUPS_LIMIT groups in a row."""


def excerpt(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


class GroupScorer:
    """Scores whole groups; keeps the counts the rollout reports on /status."""

    def __init__(self, reward: RewardFunction | None, fallback: Literal["zero", "skip_group"]):
        """`reward`: None when the run's agent scores its groups (this keeps the counts and last error only)."""
        self.reward = reward
        self.fallback = fallback
        self.failures = {"exception": 0, "timeout": 0}
        self.zero_variance_groups = 0
        self.skipped_groups = 0
        self.failed_groups_in_a_row = 0
        self.last_error = ""

    def _function(self) -> RewardFunction:
        if self.reward is None:
            raise RuntimeError("this rollout has no reward function to score with: its agent scores the groups")
        return self.reward

    async def score_one(self, record: PromptRecord, text: str) -> float | RewardError:
        reward = self._function()
        try:
            return await reward.score(record, text)
        except RewardError as e:
            return e

    async def score(self, record: PromptRecord, texts: Sequence[str]) -> list[float] | None:
        """The group's rewards, with the fallback applied; None when the group must be dropped."""
        results = await asyncio.gather(*(self.score_one(record, t) for t in texts))
        errors = [r for r in results if isinstance(r, RewardError)]
        if errors:
            self._failed(record, errors, len(results))
            if self.fallback == "skip_group":
                self.skipped_groups += 1
                SKIPPED_GROUPS.inc()
                return None
        else:
            self.failed_groups_in_a_row = 0
        rewards = [0.0 if isinstance(r, RewardError) else r for r in results]
        if len(rewards) > 1 and len(set(rewards)) == 1:
            self.zero_variance_groups += 1
            ZERO_VARIANCE.inc()
            if self.zero_variance_groups & (self.zero_variance_groups - 1) == 0:  # 1, 2, 4, 8, ...
                log.warning(
                    "zero-variance group: every sample got the same reward (GRPO learns nothing from it)",
                    extra={
                        "position": record.position,
                        "reward": rewards[0],
                        "zero_variance_groups": self.zero_variance_groups,
                    },
                )
        return rewards

    def _failed(self, record: PromptRecord, errors: list[RewardError], n: int) -> None:
        for e in errors:
            self.failures[e.kind] += 1
            REWARD_FAILURES.labels(reason=e.kind).inc()
        self.last_error = excerpt(errors[0])
        log.warning(
            "reward failed; falling back",
            extra={
                "reward": self._function().name,
                "position": record.position,
                "failed": len(errors),
                "samples": n,
                "reasons": sorted({e.kind for e in errors}),
                "fallback": self.fallback,
                "error": self.last_error,
            },
        )
        self.failed_groups_in_a_row = self.failed_groups_in_a_row + 1 if len(errors) == n else 0
        if self.failed_groups_in_a_row >= FAILED_GROUPS_LIMIT:
            raise RewardBroken(
                f"the reward {self._function().name} failed on every sample of {FAILED_GROUPS_LIMIT} "
                f"groups in a row; last error: {self.last_error}"
            )

    def counts(self) -> dict:
        """What /status shows."""
        return {
            "reward_failures": dict(self.failures),
            "zero_variance_groups": self.zero_variance_groups,
            "skipped_groups": self.skipped_groups,
        }
