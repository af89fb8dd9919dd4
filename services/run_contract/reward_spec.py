"""What a reward spec (`rollout.reward`) may name, checked without the rollout: the rollout builds the
reward from it (services/rollout/rewards), the preflight (preflight.py) and the CLI check it first.

    exact_match | math_answer | arith | letters     a built-in reward (BUILTIN_REWARD_NAMES)
    import:package.module:function                  a Python function called as fn(response, fields, prompt)
    http://host/path | https://host/path            a remote scorer
    None                                            the demo task's own verifier (prompts demo:<task>)"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable
from urllib.parse import urlsplit

from services.demo_tasks import DEMO_TASKS

# the rollout's built-in rewards (services/rollout/rewards/builtin.py); tests/run_contract/test_preflight.py keeps
# the two equal
BUILTIN_REWARD_NAMES = frozenset({"exact_match", "math_answer", "arith", "letters"})

SPEC_FORMS = (f"a built-in name ({', '.join(sorted(BUILTIN_REWARD_NAMES))}), import:module.path:function, "
              f"or an http:// or https:// URL")


def load_function(path: str) -> Callable:
    """'package.module:function' (or 'package.module:Class.method') -> the callable, checked to take
    (response, fields, prompt)."""
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"reward import path must look like module.path:function, got {path!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward import:{path}: cannot import module {module_name!r}: {e}") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"reward import:{path}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(f"reward import:{path}: {attr_path!r} is a {type(obj).__name__}, not a function")
    try:
        inspect.signature(obj).bind("response", {}, "prompt")
    except TypeError as e:
        raise ValueError(f"reward import:{path}: the function must take (response, fields, prompt): {e}") from None
    except ValueError:
        pass  # no signature to inspect (some builtins): find out at the first call
    return obj


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
        try:
            load_function(spec[len("import:"):])
        except ValueError as e:
            return str(e)
        except Exception as e:  # the module's own top level raised
            return f"reward {spec}: importing it raised {type(e).__name__}: {e}"
        return None
    if spec.startswith(("http://", "https://")):
        return None if urlsplit(spec).hostname else f"reward URL {spec!r} names no host"
    return f"unknown reward spec {spec!r}; expected {SPEC_FORMS}"
