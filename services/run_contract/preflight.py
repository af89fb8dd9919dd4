"""Preflight: what a process can check of a run's config before it spends minutes on it. The CLI calls
`check_run(config)` before it submits a run; each role calls `check_run(config, role)` at start (for what
it reads itself) and reports the problems as the run's failure (services/role/role_service.py).

    model            the directory exists and holds config.json, weights (*.safetensors or pytorch_model*.bin)
                     and, for the roles that read it, the tokenizer (tokenizer_config.json and a vocabulary)
    rollout.prompts  (and eval.prompts) demo:<task> names a demo task, or the .jsonl/.parquet file exists, is
                     readable, and its first row has rollout.prompt_field
    rollout.reward   a built-in name, an import:module:function that imports and takes
                     (response, fields, prompt), an http(s) URL with a host, or model:<engine URL or name>
                     (reward_spec.py; the judge's template and parser are checked with the run config)"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from services.demo_tasks import DEMO_TASKS
from services.model.loading import ModelDirError, check_model_dir, check_tokenizer_loads
from services.run_contract.prompt_source import check_prompt_file
from services.run_contract.agent_spec import check_agent_spec
from services.run_contract.reward_spec import check_reward_spec
from services.run_contract.run_config import RunConfig
from services.run_contract.run_policy import RunPolicy

# what each role reads itself, so what it checks at start (None: the CLI, everything)
ROLE_CHECKS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"tokenizer", "prompts", "reward"}),
    "trainer": frozenset({"weights", "tokenizer"}),  # its checkpoints carry the tokenizer
    "critic": frozenset({"weights"}),
    "actor_fwd": frozenset({"weights"}),
    "reference": frozenset({"weights"}),
    "advantage": frozenset(),
}
EVERYTHING = frozenset({"weights", "tokenizer", "prompts", "reward"})


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a run's config: the key (dotted, as in the run's YAML) and what is wrong."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def check_run(config: RunConfig, role: str | None = None, policy: RunPolicy | None = None) -> list[Problem]:
    """Every problem found with `config` (empty: it may run). `role` limits the checks to what that role
    reads (ROLE_CHECKS); None checks everything. Importing an import: reward runs its module's top level, so
    the operator's `policy` (run_policy.py) is checked first: a run outside it is refused before anything of
    it is imported or read."""
    if policy is not None and (outside := policy.violations(config)):
        return [Problem(key, message) for key, message in outside]
    checks = EVERYTHING if role is None else ROLE_CHECKS.get(role, frozenset())
    problems = []
    if checks & {"weights", "tokenizer"}:
        try:
            check_model_dir(config.model, weights="weights" in checks, tokenizer="tokenizer" in checks)
            if role is None:  # at submit: do its files load (a malformed tokenizer.json)? A role that reads the
                check_tokenizer_loads(config.model)  # tokenizer loads it at start anyway, its error reported alike
        except ModelDirError as exc:
            problems.append(Problem("model", str(exc)))
    r = config.rollout
    if "prompts" in checks:
        problems += _prompt_problems("rollout.prompts", r.prompts, r.prompt_field)
        eval_prompts = config.eval.prompts
        if eval_prompts is not None:
            problems += _prompt_problems("eval.prompts", eval_prompts, r.prompt_field)
    if "reward" in checks:
        message = check_reward_spec(r.reward, r.prompts) if not (r.agent and r.reward is None) else None
        if message is not None:
            problems.append(Problem("rollout.reward", message))
        if (message := check_agent_spec(r.agent)) is not None:
            problems.append(Problem("rollout.agent", message))
    return problems


def describe(problems: list[Problem]) -> str:
    """One line naming every problem (a failure report, a CLI error)."""
    return "; ".join(str(p) for p in problems)


def _prompt_problems(key: str, spec: str, prompt_field: str) -> list[Problem]:
    if spec.startswith("demo:"):
        if spec[len("demo:") :] in DEMO_TASKS:
            return []
        known = ", ".join("demo:" + t for t in sorted(DEMO_TASKS))
        return [Problem(key, f"unknown demo task {spec!r}; known: {known}")]
    suffix = os.path.splitext(spec)[1].lower()
    if suffix not in (".jsonl", ".parquet"):
        return [Problem(key, f"{spec!r} must be a .jsonl or .parquet file, or demo:<task>")]
    if not os.path.isfile(spec):
        return [Problem(key, f"{spec} does not exist" if not os.path.exists(spec) else f"{spec} is not a file")]
    try:
        check_prompt_file(Path(spec), prompt_field)  # the rollout's own reader, on the first row or the schema
    except OSError as exc:
        return [Problem(key, f"{spec} cannot be read: {exc.strerror or exc}")]
    except ValueError as exc:
        return [Problem(key, str(exc))]
    return []
