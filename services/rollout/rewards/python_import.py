"""A user's reward function, named by import path: `import:my_pkg.verifiers:score_answer`.

The function is called as `fn(response, fields, prompt)`:
    response  str, the generated text
    fields    dict, the row's other fields (labels etc.); a copy, so the function may change it
    prompt    str or list of chat messages, the row's prompt
and returns a number (bool, int or float; numpy scalars are numbers too). It may be a plain function,
which runs in a worker thread (asyncio.to_thread) so a slow verifier does not stall the event loop, or
an `async def`, which is awaited on the loop. Whatever it raises comes back as RewardError. A call that has not
returned after timeout_s is a RewardError of kind "timeout" (an async function is cancelled; a thread cannot
be, so a plain function that never returns keeps one worker thread)."""

from __future__ import annotations

import asyncio
import copy
import inspect
from typing import Callable

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards.errors import RewardError
from services.rollout.rewards.reward_function import RewardFunction, finite_reward
from services.run_contract.reward_spec import load_function  # shared with the preflight

__all__ = ["ImportedReward", "load_function"]


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


class ImportedReward(RewardFunction):
    def __init__(self, path: str, timeout_s: float | None = None):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s!r}")
        self.name = f"import:{path}"
        self.timeout_s = timeout_s
        self._fn = load_function(path)
        self._async = _is_async(self._fn)

    async def score(self, record: PromptRecord, response: str) -> float:
        args = (response, copy.deepcopy(record.fields), copy.deepcopy(record.prompt))
        try:
            async with asyncio.timeout(self.timeout_s):
                value = await self._call(args)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            raise RewardError(
                f"reward function {self.name} gave no answer within {self.timeout_s}s", "timeout"
            ) from None
        except Exception as e:
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {e}") from e
        return finite_reward(value, f"reward function {self.name}")

    async def _call(self, args: tuple):
        if self._async:
            return await self._fn(*args)
        value = await asyncio.to_thread(self._fn, *args)
        if inspect.isawaitable(value):  # a plain function that hands back a coroutine
            value = await value
        return value
