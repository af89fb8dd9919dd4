"""Reward functions for the rollout service: one interface (RewardFunction.score / aclose), three kinds.

    build_reward("math_answer")                          built-in (builtin.py: BUILTIN_REWARDS)
    build_reward("import:my_pkg.verify:score")           a Python function (python_import.py)
    build_reward("https://judge.internal/score")         a remote HTTP endpoint (remote_http.py)

Every reward is a finite float; anything else, and every failure, is a RewardError (its `kind`: exception or
timeout). What the rollout does with one is services/rollout/scoring.py (rollout.reward_fallback)."""

from __future__ import annotations

from services.rollout.rewards.builtin import BUILTIN_REWARDS, BuiltinReward
from services.rollout.rewards.errors import RewardError
from services.rollout.rewards.python_import import ImportedReward
from services.rollout.rewards.remote_http import RemoteReward
from services.rollout.rewards.reward_function import RewardFunction

__all__ = ["BUILTIN_REWARDS", "RewardError", "RewardFunction", "build_reward"]

SPEC_FORMS = (f"a built-in name ({', '.join(sorted(BUILTIN_REWARDS))}), import:module.path:function, "
              f"or an http:// or https:// URL")


def build_reward(spec: str, *, label_field: str = "label", timeout_s: float = 30.0, retries: int = 3,
                 token: str | None = None) -> RewardFunction:
    """label_field is read by exact_match and math_answer; timeout_s bounds one call of an imported function
    and one attempt of a URL; retries and token (a bearer token) apply to a URL and are ignored by the other
    kinds."""
    if not isinstance(spec, str):
        raise ValueError(f"reward spec must be {SPEC_FORMS}; got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BuiltinReward(spec, label_field)
    if spec.startswith("import:"):
        return ImportedReward(spec[len("import:"):], timeout_s=timeout_s)
    if spec.startswith(("http://", "https://")):
        return RemoteReward(spec, timeout_s=timeout_s, retries=retries, token=token)
    raise ValueError(f"unknown reward spec {spec!r}; expected {SPEC_FORMS}")
