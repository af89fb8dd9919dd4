"""The operator's run policy (services/run_contract/run_policy.py): what each allow-list lets through."""

from __future__ import annotations

import os

from services.run_contract.run_config import RunConfig
from services.run_contract.run_policy import RunPolicy, RunPolicySettings


def _run(**rollout) -> RunConfig:
    return RunConfig(name="p", model="/models/m", rollout={"prompts": "demo:reverse", **rollout})


def test_empty_policy_allows_everything():
    assert RunPolicy().violations(_run(reward="import:anything.at.all:f")) == []
    assert RunPolicy().violations(_run(reward="https://anywhere.example/score")) == []


def test_reward_modules_allow_the_module_and_its_submodules_only():
    policy = RunPolicy(reward_modules=("team_rewards",))
    assert policy.violations(_run(reward="import:team_rewards:f")) == []
    assert policy.violations(_run(reward="import:team_rewards.math.v2:score")) == []
    for other in ("import:team_rewards_evil:f", "import:os:system", "import:team:f"):
        [(key, message)] = policy.violations(_run(reward=other))
        assert key == "rollout.reward" and "--allow-reward-modules" in message
    assert policy.violations(_run(reward="exact_match")) == []  # built-ins are not imports


def test_reward_hosts_are_matched_exactly():
    policy = RunPolicy(reward_hosts=("judge.internal",))
    assert policy.violations(_run(reward="https://judge.internal:8443/score")) == []
    [(key, message)] = policy.violations(_run(reward="http://judge.internal.attacker.example/score"))
    assert key == "rollout.reward" and "judge.internal.attacker.example" in message


def test_data_roots_resolve_symlinks_and_dot_dots(tmp_path):
    root, outside = tmp_path / "data", tmp_path / "secrets"
    root.mkdir(), outside.mkdir()
    (outside / "key.jsonl").write_text("{}\n")
    os.symlink(outside / "key.jsonl", root / "link.jsonl")
    policy = RunPolicy(data_roots=(str(root),))
    inside = RunConfig(name="p", model=str(root / "model"), rollout={"prompts": str(root / "train.jsonl")})
    assert policy.violations(inside) == []
    for prompts in (str(root / "link.jsonl"), str(root / ".." / "secrets" / "key.jsonl")):
        run = RunConfig(name="p", model=str(root / "model"), rollout={"prompts": prompts})
        assert [key for key, _ in policy.violations(run)] == ["rollout.prompts"], prompts
    run = RunConfig(name="p", model="/etc", rollout={"prompts": "demo:reverse"}, eval={"prompts": "/tmp/x.jsonl"})
    assert [key for key, _ in policy.violations(run)] == ["model", "eval.prompts"]


def test_the_settings_read_one_env_var_each(monkeypatch):
    monkeypatch.setenv("SLUICE_ALLOW_REWARD_MODULES", "a, b.c")
    monkeypatch.setenv("SLUICE_DATA_ROOTS", "/data")
    policy = RunPolicySettings().run_policy()
    assert policy == RunPolicy(reward_modules=("a", "b.c"), reward_hosts=(), data_roots=("/data",))


def test_reward_hosts_hold_a_judge_by_url_but_not_one_the_operator_named():
    policy = RunPolicy(reward_hosts=("judge.internal",))
    assert policy.violations(_run(reward="model:http://judge.internal:30000")) == []
    assert policy.violations(_run(reward="model:judge")) == []  # the rollout's --judge-urls: the operator's
    [(key, message)] = policy.violations(_run(reward="model:https://elsewhere.example:30000"))
    assert key == "rollout.reward" and "'elsewhere.example'" in message and "--allow-reward-hosts" in message
