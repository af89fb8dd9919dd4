"""Reward functions for the rollout service: one interface (RewardFunction.score / aclose), four kinds.

    build_reward("math_answer")                          built-in (builtin.py: BUILTIN_REWARDS)
    build_reward("import:my_pkg.verify:score")           a Python function (python_import.py)
    build_reward("https://judge.internal/score")         a remote HTTP endpoint (remote_http.py)
    build_reward("model:http://judge:30000")             a judge model on an engine (model_judge.py);
    build_reward("model:judge", judge_urls={"judge": url})   ... named, its URL from the rollout's --judge-urls

Every reward is a finite float; anything else, and every failure, is a RewardError (its `kind`: exception or
timeout). What the rollout does with one is services/rollout/scoring.py (rollout.reward_fallback)."""

from __future__ import annotations

from typing import Callable

from services.rollout.rewards.builtin import BUILTIN_REWARDS, BuiltinReward
from services.rollout.rewards.errors import RewardError
from services.rollout.rewards.model_judge import JudgeClient, JudgeReward
from services.rollout.rewards.python_import import ImportedReward
from services.rollout.rewards.remote_http import RemoteReward
from services.rollout.rewards.reward_function import RewardFunction
from services.run_contract.judge_settings import JudgeSettings
from services.sglang_protocol.client import SGLangClient

__all__ = ["BUILTIN_REWARDS", "RewardError", "RewardFunction", "build_reward"]

SPEC_FORMS = (
    f"a built-in name ({', '.join(sorted(BUILTIN_REWARDS))}), import:module.path:function, "
    f"an http:// or https:// URL, or model:<engine URL or name>"
)


def build_reward(
    spec: str,
    *,
    label_field: str = "label",
    timeout_s: float = 30.0,
    retries: int = 3,
    token: str | None = None,
    judge: JudgeSettings | None = None,
    judge_urls: dict[str, str] | None = None,
    engine_key: str | None = None,
    judge_client: Callable[..., JudgeClient] = SGLangClient,
) -> RewardFunction:
    """label_field is read by exact_match and math_answer; timeout_s bounds one call of an imported function
    and one attempt of a URL or judge; retries apply to a URL and a judge; token (a bearer token) to a URL.
    A judge (model:...) follows `judge` (rollout.judge), finds a named engine in judge_urls, and sends
    engine_key, the stack's token, as every engine client does (never `token`: that is a third party's)."""
    if not isinstance(spec, str):
        raise ValueError(f"reward spec must be {SPEC_FORMS}; got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BuiltinReward(spec, label_field)
    if spec.startswith("import:"):
        return ImportedReward(spec[len("import:") :], timeout_s=timeout_s)
    if spec.startswith(("http://", "https://")):
        return RemoteReward(spec, timeout_s=timeout_s, retries=retries, token=token)
    if spec.startswith("model:"):
        url = judge_url(spec[len("model:") :], judge_urls or {})
        return JudgeReward(
            url, judge or JudgeSettings(), client=judge_client, timeout_s=timeout_s, retries=retries, api_key=engine_key
        )
    raise ValueError(f"unknown reward spec {spec!r}; expected {SPEC_FORMS}")


def judge_url(target: str, judge_urls: dict[str, str]) -> str:
    """The engine URL of model:<target>: the target itself when it is a URL, else the URL judge_urls names."""
    if target.startswith(("http://", "https://")):
        return target
    if target not in judge_urls:
        known = ", ".join(sorted(judge_urls)) or "none"
        raise ValueError(
            f"reward model:{target} names judge engine {target!r}, which the rollout's --judge-urls "
            f"does not name (it names: {known}); `sluice run` names the stack's as judge "
            f"(stack.judge.model)"
        )
    return judge_urls[target]
