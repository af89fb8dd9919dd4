"""A model as the reward (`rollout.reward: model:<engine>`): the judge's prompt template and how its answer
becomes a number, checked here so that a bad template or parser is refused when the run is created, not on
the first sample. The rollout renders and parses (services/rollout/rewards/model_judge.py).

    template   str.format-style text: {prompt}, {response} and any field of the row ({label}, ...);
               {{ and }} are literal braces. Plain names only: no {x.attr}, {x[0]}, {x!r} or {x:spec}
    parser     yes_no          the answer's first whole word yes / no (any case) -> 1.0 / 0.0
               regex:PATTERN   the first match of PATTERN in the answer; its one capturing group (or the
                               whole match, with no group) read as a number"""

from __future__ import annotations

import re
from string import Formatter

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_TEMPLATE = (
    "Question:\n{prompt}\n\nAnswer:\n{response}\n\nIs the answer correct? Reply with yes or no.\nVerdict:"
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
JUDGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # model:<name>: an engine named to the rollout


def template_fields(template: str) -> list[str]:
    """The names `template` fills in, in order; ValueError naming a placeholder that is not a plain name."""
    names = []
    try:
        pieces = list(Formatter().parse(template))
    except ValueError as exc:  # a lone { or }
        raise ValueError(
            f"rollout.judge.template is not a valid template ({exc}); write {{{{ and }}}} for literal braces"
        ) from None
    for _, name, spec, conversion in pieces:
        if name is None:
            continue
        if not _NAME.fullmatch(name) or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(
                f"rollout.judge.template: placeholder {shown} must be a plain name such as {{response}} or {{label}}"
            )
        names.append(name)
    return names


def compile_parser(spec: str) -> re.Pattern | None:
    """None for yes_no, else regex:PATTERN compiled; ValueError naming what is wrong."""
    if spec == "yes_no":
        return None
    if not spec.startswith("regex:"):
        raise ValueError(f"rollout.judge.parser must be yes_no or regex:PATTERN, got {spec!r}")
    try:
        pattern = re.compile(spec[len("regex:") :])
    except re.error as exc:
        raise ValueError(
            f"rollout.judge.parser: {spec[len('regex:') :]!r} is not a valid regular expression ({exc})"
        ) from None
    if pattern.groups > 1:
        raise ValueError(
            f"rollout.judge.parser: the pattern has {pattern.groups} capturing groups; give one "
            f"(the number) or none (the whole match), and write others as (?:...)"
        )
    return pattern


class JudgeSettings(BaseModel):
    """How a model judges each sample when rollout.reward is model:<engine> (docs/rewards.md, "A model as
    judge"); ignored by every other reward."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    template: str = Field(
        DEFAULT_TEMPLATE,
        min_length=1,
        max_length=65536,
        description=(
            "the judge's prompt, sent as text (no chat template): {prompt}, {response} and the row's fields by name "
            "({label}, ...); {{ }} are literal braces; it must hold {response}"
        ),
    )
    parser: str = Field(
        "yes_no",
        min_length=1,
        max_length=1024,
        description=(
            "how the answer becomes the reward: yes_no = its first word yes / no (any case) scores 1 / 0; "
            "regex:PATTERN = the first match, its one capturing group (or the whole match) read as a number"
        ),
    )
    default: float | None = Field(
        None,
        ge=-1e9,
        le=1e9,
        description=(
            "the reward of an answer the parser finds nothing in; None = such an answer is a reward failure "
            "(counted, and rollout.reward_fallback applies)"
        ),
    )
    max_new_tokens: int = Field(16, ge=1, le=1 << 16, description="most tokens of the judge's answer")
    temperature: float = Field(0.0, ge=0, le=10, description="the judge's sampling temperature; 0 = greedy")
    timeout_s: float | None = Field(
        None, gt=0, le=86400, description=("time limit of one judge request, seconds; None = rollout.reward_timeout_s")
    )
    retries: int | None = Field(
        None,
        ge=0,
        le=20,
        description=("retries of a judge request that got no answer or a 5xx; None = rollout.reward_retries"),
    )

    @field_validator("template")
    @classmethod
    def _template(cls, template: str) -> str:
        if "response" not in template_fields(template):
            raise ValueError("rollout.judge.template must hold {response}: the judge would never see the answer")
        return template

    @field_validator("parser")
    @classmethod
    def _parser(cls, spec: str) -> str:
        compile_parser(spec)
        return spec
