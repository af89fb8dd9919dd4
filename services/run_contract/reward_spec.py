"""What a reward spec (`rollout.reward`) may name, checked without the rollout: the rollout builds the
reward from it (services/rollout/rewards), the preflight (preflight.py) and the CLI check it first.

    exact_match | math_answer | arith | letters     a built-in reward (BUILTIN_REWARD_NAMES)
    import:package.module:function                  a Python function called as fn(response, fields, prompt)
    http://host/path | https://host/path            a remote scorer
    model:http://host:port | model:<name>           a judge model on an engine (judge_settings.py): its URL,
                                                    or a name the rollout's --judge-urls maps to one
    None                                            the demo task's own verifier (prompts demo:<task>)"""

from __future__ import annotations

from typing import Callable
from urllib.parse import urlsplit

from services.demo_tasks import DEMO_TASKS
from services.run_contract.judge_settings import JUDGE_NAME
from services.run_contract.imported_functions import check_import, import_function

# the rollout's built-in rewards (services/rollout/rewards/builtin.py); tests/run_contract/test_preflight.py keeps
# the two equal
BUILTIN_REWARD_NAMES = frozenset({"exact_match", "math_answer", "arith", "letters"})

SPEC_FORMS = (
    f"a built-in name ({', '.join(sorted(BUILTIN_REWARD_NAMES))}), import:module.path:function, "
    f"an http:// or https:// URL, or model:<engine URL or name>"
)


def load_function(path: str) -> Callable:
    """'package.module:function' (or 'package.module:Class.method') -> the callable, checked to take
    (response, fields, prompt)."""
    return import_function(path, "reward", ("response", {}, "prompt"), "(response, fields, prompt)")


def check_reward_spec(spec: str | None, prompts: str) -> str | None:
    """What is wrong with `spec` for a run whose prompts are `prompts`, or None. An import: spec is
    imported (its module's top level runs) and its signature checked; a URL is checked for form only."""
    if spec is None:
        task = prompts.removeprefix("demo:")
        if prompts.startswith("demo:") and task in DEMO_TASKS:
            return None
        return "is required unless rollout.prompts is a demo task (demo:<task>)"
    if spec in BUILTIN_REWARD_NAMES:
        return None
    if spec.startswith("import:"):
        return check_import(spec, "reward", load_function)
    if spec.startswith(("http://", "https://")):
        return None if urlsplit(spec).hostname else f"reward URL {spec!r} names no host"
    if spec.startswith("model:"):
        return check_judge_target(spec[len("model:") :])
    return f"unknown reward spec {spec!r}; expected {SPEC_FORMS}"


def check_judge_target(target: str) -> str | None:
    """What is wrong with the engine of `model:<target>`, or None: an http(s) URL with a host, or a name."""
    if target.startswith(("http://", "https://")):
        return None if urlsplit(target).hostname else f"judge engine URL {target!r} names no host"
    if JUDGE_NAME.fullmatch(target):
        return None
    return (
        f"reward {'model:' + target!r}: expected model:http(s)://host:port (a judge engine) or model:<name> (letters, "
        f"digits, _ . -; an engine the rollout's --judge-urls names, e.g. the stack's judge)"
    )
