"""A model as the reward (`rollout.reward: model:<engine>`): each sample's judge prompt (rollout.judge.template,
filled with the prompt, the response and the row's fields) goes to an engine's /generate (the built-in engine,
or SGLang) as text; the answer, parsed by rollout.judge.parser, is the reward.

    render_prompt(template, record, response)   the judge's prompt
    parse_answer(answer, parser)                the reward, or None when the parser finds nothing in it

Timeouts and retries are every remote reward's (retries.py): a request that gets no answer in timeout_s, cannot
connect or gets a 5xx is tried again; a 4xx (a prompt over the judge's context length, say) fails at once. An
answer the parser finds nothing in is a RewardError naming the answer, or rollout.judge.default where one is
set; either way it is counted (sluice_rollout_judge_unparsed_total)."""

from __future__ import annotations

import json
import re
from string import Formatter
from typing import Callable, Protocol

from prometheus_client import Counter

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards.builtin import parse_number
from services.rollout.rewards.errors import RewardError
from services.rollout.rewards.retries import Transient, check_limits, with_retries
from services.rollout.rewards.reward_function import RewardFunction, finite_reward
from services.run_contract.judge_settings import JudgeSettings, compile_parser, template_fields
from services.sglang_protocol.client import EngineUnreachable, SGLangError

UNPARSED = Counter(
    "sluice_rollout_judge_unparsed_total",
    "judge answers the parser found no reward in (a failure, or rollout.judge.default)",
)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


class JudgeClient(Protocol):
    """What the judge uses of an engine's client (SGLangClient)."""

    async def generate_text(self, text: str, sampling_params: dict) -> str: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...


def prompt_text(prompt) -> str:
    """The row's prompt as text: itself, or chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in prompt)


def render_prompt(template: str, record: PromptRecord, response: str) -> str:
    """template with {prompt}, {response} and the row's fields filled in (a field that is not text as JSON);
    RewardError naming a field the row lacks."""
    values = {"prompt": prompt_text(record.prompt), "response": response}
    out = []
    for literal, name, _, _ in _pieces(template):
        out.append(literal)
        if name is None:
            continue
        if name in values:
            out.append(values[name])
        elif name in record.fields and record.fields[name] is not None:
            value = record.fields[name]
            out.append(value if isinstance(value, str) else json.dumps(value))
        else:
            raise RewardError(
                f"rollout.judge.template needs the field {name!r}; the row at position "
                f"{record.position} has {sorted(record.fields)}"
            )
    return "".join(out)


def _pieces(template: str):
    template_fields(template)  # the form was checked with the run config; this keeps a hand-made one honest
    return Formatter().parse(template)


def parse_answer(answer: str, parser: str) -> float | None:
    """The reward in the judge's answer, or None. yes_no: the first whole word yes / no -> 1.0 / 0.0;
    regex:PATTERN: the first match, its capturing group (or the whole match) read as a number
    (42, -3, 0.5, 7/2, 1,000: builtin.parse_number)."""
    pattern = compile_parser(parser)
    if pattern is None:
        match = _YES_NO.search(answer)
        return None if match is None else float(match.group(1).lower() == "yes")
    match = pattern.search(answer)
    if match is None:
        return None
    text = match.group(1) if pattern.groups else match.group(0)
    value = parse_number(text) if text is not None else None
    return None if value is None else float(value)


class JudgeReward(RewardFunction):
    """rollout.reward model:<url>: one client (SGLangClient; a fake in role tests) to the judge engine."""

    def __init__(
        self,
        url: str,
        settings: JudgeSettings,
        *,
        client: Callable[..., JudgeClient],
        timeout_s: float,
        retries: int,
        api_key: str | None = None,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
    ):
        self.timeout_s = settings.timeout_s if settings.timeout_s is not None else timeout_s
        self.retries = settings.retries if settings.retries is not None else retries
        check_limits(self.timeout_s, self.retries)
        self.name = f"model:{url}"
        self.url = url
        self.settings = settings
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.sampling = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature}
        self._client = client(url, timeout_s=self.timeout_s, api_key=api_key)

    async def aclose(self) -> None:
        await self._client.aclose()
        self._client.close()

    async def score(self, record: PromptRecord, response: str) -> float:
        text = render_prompt(self.settings.template, record, response)
        answer = await with_retries(
            lambda: self._attempt(text),
            f"judge engine {self.url}",
            timeout_s=self.timeout_s,
            retries=self.retries,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
        )
        value = parse_answer(answer, self.settings.parser)
        if value is None:
            UNPARSED.inc()
            if self.settings.default is None:
                raise RewardError(
                    f"judge engine {self.url}: parser {self.settings.parser} found no reward in its "
                    f"answer {_excerpt(answer)} (rollout.judge.default would score it instead)"
                )
            return self.settings.default
        return finite_reward(value, f"judge engine {self.url}")

    async def _attempt(self, text: str) -> str:
        try:
            return await self._client.generate_text(text, self.sampling)
        except EngineUnreachable as e:
            raise Transient(e.message) from e
        except SGLangError as e:
            if e.status >= 500:
                raise Transient(f"HTTP {e.status}: {_excerpt(e.message)}") from e
            raise RewardError(
                f"judge engine {self.url} refused the request: HTTP {e.status}: {_excerpt(e.message)}"
            ) from e


def _excerpt(text: str, limit: int = 300) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "..."
