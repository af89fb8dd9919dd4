"""A user's reward function, named by import path: `import:my_pkg.verifiers:score_answer`.

The function is called as `fn(response, fields, prompt)`:
    response  str, the generated text
    fields    dict, the row's other fields (labels etc.); a copy, so the function may change it
    prompt    str or list of chat messages, the row's prompt
and returns a number (bool, int or float; numpy scalars are numbers too). It may be a plain function,
which runs in a worker thread (asyncio.to_thread) so a slow verifier does not stall the event loop, or
an `async def`, which is awaited on the loop. Whatever it raises comes back as RewardError."""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
from typing import Callable

from services.rollout.prompts import PromptRecord
from services.rollout.rewards.errors import RewardError
from services.rollout.rewards.reward_function import RewardFunction, finite_reward


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


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class ImportedReward(RewardFunction):
    def __init__(self, path: str):
        self.name = f"import:{path}"
        self._fn = load_function(path)
        self._async = _is_async(self._fn)

    async def score(self, record: PromptRecord, response: str) -> float:
        args = (response, copy.deepcopy(record.fields), copy.deepcopy(record.prompt))
        try:
            if self._async:
                value = await self._fn(*args)
            else:
                value = await asyncio.to_thread(self._fn, *args)
                if inspect.isawaitable(value):  # a plain function that hands back a coroutine
                    value = await value
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {e}") from e
        return finite_reward(value, f"reward function {self.name}")
