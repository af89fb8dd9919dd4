"""What an operator lets a run config reach, beyond the token: a run's reward is code the rollout imports and
its paths are files the roles read, so on a shared cluster a token holder could otherwise import any module
on the rollout's path, post samples to any host, or point `model` and `prompts` at any file a role can read.

Every role service takes the policy (flags or env, RunPolicySettings) and its preflight refuses a run that
leaves it: the run fails at start with the key and the rule it broke, before anything is imported or read.

    --allow-reward-modules a.b,c    import: rewards only from these modules or their submodules
    --allow-reward-hosts h1,h2      http(s) rewards (and model:http(s) judges) only to these hosts
    --data-roots /data,/models      model and prompt files only under these directories (symlinks resolved)

Each is empty by default: no restriction (a single-user machine). docs/security.md says how to deploy them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.run_contract.run_config import RunConfig


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


class RunPolicySettings(BaseSettings):
    """The operator's run policy, as every role service reads it (see the module docstring); one env var each,
    shared by every service of the stack."""

    model_config = SettingsConfigDict(populate_by_name=True)

    allow_reward_modules: str = Field(
        "",
        validation_alias="SLUICE_ALLOW_REWARD_MODULES",
        description=(
            "comma-separated modules an import: reward or agent may come from (and their submodules); empty = any"
        ),
    )
    allow_reward_hosts: str = Field(
        "",
        validation_alias="SLUICE_ALLOW_REWARD_HOSTS",
        description=(
            "comma-separated hosts an http(s) reward, model:http(s) judge or agent environment may be posted to; "
            "empty = any"
        ),
    )
    data_roots: str = Field(
        "",
        validation_alias="SLUICE_DATA_ROOTS",
        description=("comma-separated directories the run's model and prompt files must be under; empty = anywhere"),
    )

    def run_policy(self) -> "RunPolicy":
        return RunPolicy(_csv(self.allow_reward_modules), _csv(self.allow_reward_hosts), _csv(self.data_roots))


@dataclass(frozen=True)
class RunPolicy:
    reward_modules: tuple[str, ...] = ()
    reward_hosts: tuple[str, ...] = ()
    data_roots: tuple[str, ...] = ()

    def violations(self, config: RunConfig) -> list[tuple[str, str]]:
        """(key, what is wrong) for each part of `config` outside the policy."""
        found = []
        reward = config.rollout.reward or ""
        for key, spec in (("rollout.reward", reward), ("rollout.agent", config.rollout.agent or "")):
            if spec.startswith("import:") and self.reward_modules:
                module = spec[len("import:") :].partition(":")[0]
                if not any(module == m or module.startswith(m + ".") for m in self.reward_modules):
                    found.append(
                        (
                            key,
                            f"module {module!r} is not among the allowed reward modules "
                            f"({', '.join(self.reward_modules)}; --allow-reward-modules)",
                        )
                    )
        # a judge by URL (model:http...) gets samples and the stack's token: held to the same hosts; a judge by
        # name is the operator's own (the rollout's --judge-urls)
        judge = reward[len("model:") :] if reward.startswith("model:") else ""
        for key, spec in (
            ("rollout.reward", reward),
            ("rollout.agent", config.rollout.agent or ""),
            ("rollout.reward", judge),
        ):
            if spec.startswith(("http://", "https://")) and self.reward_hosts:
                host = urlsplit(spec).hostname or ""
                if host not in self.reward_hosts:
                    found.append(
                        (
                            key,
                            f"host {host!r} is not among the allowed reward hosts "
                            f"({', '.join(self.reward_hosts)}; --allow-reward-hosts)",
                        )
                    )
        if self.data_roots:
            paths = [
                ("model", config.model),
                ("rollout.prompts", config.rollout.prompts),
                ("eval.prompts", config.eval.prompts),
            ]
            for key, path in paths:
                if path and not path.startswith("demo:") and not self._under_a_root(path):
                    found.append(
                        (key, f"{path} is outside the allowed data roots ({', '.join(self.data_roots)}; --data-roots)")
                    )
        return found

    def _under_a_root(self, path: str) -> bool:
        real = os.path.realpath(path)
        return any(
            os.path.commonpath([real, os.path.realpath(root)]) == os.path.realpath(root) for root in self.data_roots
        )
