"""A model as the reward (model_judge.py): the judge's prompt from its template, the reward from its answer, and a
judge engine's failures handled as the HTTP reward's are, against an in-memory judge client."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards import RewardError, build_reward
from services.rollout.rewards.model_judge import JudgeReward, parse_answer, render_prompt
from services.run_contract.judge_settings import JudgeSettings
from services.run_contract.reward_spec import check_reward_spec
from services.sglang_protocol.client import EngineUnreachable, SGLangError


def row(prompt="What is 6 x 7?", **fields) -> PromptRecord:
    return PromptRecord(position=3, epoch=0, index=3, prompt=prompt, fields=fields)


# ------------------------------------------------------------------------------------- the template


def test_template_fills_prompt_response_and_fields():
    template = "Q: {prompt}\nA: {response}\nExpected {label} ({difficulty}, {tags}). {{not a field}}"
    text = render_prompt(template, row(label="42", difficulty=2, tags=["x", "y"]), "It is 42")
    assert text == 'Q: What is 6 x 7?\nA: It is 42\nExpected 42 (2, ["x", "y"]). {not a field}'


def test_template_renders_chat_prompts_as_role_lines():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 x 7?"}]
    assert render_prompt("{prompt}|{response}", row(prompt=messages), "42") == "system: Be brief.\nuser: 6 x 7?|42"


def test_prompt_and_response_are_not_taken_from_the_row():
    assert render_prompt("{prompt}/{response}", row(prompt="p", response="r0"), "r") == "p/r"


def test_a_field_the_row_lacks_is_a_reward_failure_naming_it():
    with pytest.raises(RewardError, match=r"needs the field 'label'; the row at position 3 has \['other'\]"):
        render_prompt("{response} vs {label}", row(other=1), "x")


@pytest.mark.parametrize(
    "template, message",
    [
        ("Rate this.", "must hold {response}"),
        ("{response} {label.upper}", r"placeholder \{label.upper\} must be a plain name"),
        ("{response} {fields[0]}", "must be a plain name"),
        ("{response!r}", r"placeholder \{response!r\}"),
        ("{response:>10}", r"placeholder \{response:>10\}"),
        ("{response} {}", "must be a plain name"),
        ("{response} }", "not a valid template"),
    ],
)
def test_bad_templates_are_refused_with_the_config(template, message):
    with pytest.raises(ValidationError, match=message):
        JudgeSettings(template=template)


# ------------------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("Yes, it is right.", 1.0),
        (" no.", 0.0),
        ("NO", 0.0),
        ("yes or no? no", 1.0),  # the first one counts
        ("Nope, yesterday", None),
        ("", None),
        ("The answer is correct", None),
    ],
)
def test_yes_no(answer, expected):
    assert parse_answer(answer, "yes_no") == expected


@pytest.mark.parametrize(
    "answer, parser, expected",
    [
        ("Score: 7/10", r"regex:Score:\s*(\d+)", 7.0),
        ("Score: 7/10 and Score: 2", r"regex:Score:\s*(\d+)", 7.0),  # the first match
        ("rating -0.5", r"regex:rating (\S+)", -0.5),
        ("3/4", r"regex:\d+/\d+", 0.75),  # no group: the whole match
        ("Score: none", r"regex:Score:\s*(\w+)", None),  # the group is not a number
        ("no score here", r"regex:Score:\s*(\d+)", None),
        ("grade A", r"regex:(\d+)?\s*A", None),  # the group did not take part
    ],
)
def test_regex(answer, parser, expected):
    assert parse_answer(answer, parser) == expected


@pytest.mark.parametrize(
    "parser, message",
    [
        ("likert", "yes_no or regex:PATTERN"),
        ("regex:(", "not a valid regular expression"),
        (r"regex:(\d+)/(\d+)", "2 capturing groups"),
    ],
)
def test_bad_parsers_are_refused_with_the_config(parser, message):
    with pytest.raises(ValidationError, match=message):
        JudgeSettings(parser=parser)


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("model:http://judge:30000", None),
        ("model:judge", None),
        ("model:judge-2.b", None),
        ("model:http://", "names no host"),
        ("model:", "expected model:http"),
        ("model:a b", "expected model:http"),
    ],
)
def test_reward_spec_forms(spec, problem):
    found = check_reward_spec(spec, "data.jsonl")
    assert found == problem if problem is None else problem in found


# ------------------------------------------------------------------------------------- against an engine


class ScriptedJudge:
    """An in-memory judge engine client: answers (or raises) from a script, one entry per request."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list[tuple[str, dict]] = []
        self.closed = False

    def __call__(self, url, timeout_s, api_key=None):  # the client factory of build_reward
        self.url, self.api_key = url, api_key
        return self

    async def generate_text(self, text, sampling_params):
        self.requests.append((text, sampling_params))
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        if step == "hang":
            await asyncio.sleep(60)
        return step

    async def aclose(self):
        self.closed = True

    def close(self):
        pass


def judge(script, **settings) -> tuple[JudgeReward, ScriptedJudge]:
    client = ScriptedJudge(script)
    reward = build_reward(
        "model:judge",
        judge=JudgeSettings(template="{response} ok?", **settings),
        judge_urls={"judge": "http://judge:1"},
        engine_key="stack-token",
        judge_client=client,
        timeout_s=5,
        retries=2,
        token="third-party",
    )
    reward.backoff_s = 0.001
    return reward, client


def unparsed() -> float:
    return REGISTRY.get_sample_value("sluice_rollout_judge_unparsed_total") or 0.0


async def test_the_answer_is_the_reward():
    reward, client = judge(["Yes."], max_new_tokens=4, temperature=0.5)
    assert await reward.score(row(), "42") == 1.0
    assert client.requests == [("42 ok?", {"max_new_tokens": 4, "temperature": 0.5})]
    assert (client.url, client.api_key) == ("http://judge:1", "stack-token")  # never the reward_token
    await reward.aclose()
    assert client.closed


async def test_unreachable_and_5xx_are_retried():
    reward, client = judge([EngineUnreachable("/generate", "refused"), SGLangError("/generate", 503, "full"), "no"])
    assert await reward.score(row(), "41") == 0.0
    assert len(client.requests) == 3


async def test_the_retries_run_out():
    reward, client = judge([EngineUnreachable("/generate", "refused")] * 3)
    with pytest.raises(RewardError, match=r"judge engine http://judge:1 failed 3 time\(s\); last: refused") as e:
        await reward.score(row(), "41")
    assert e.value.kind == "exception"


async def test_4xx_is_not_retried():
    reward, client = judge([SGLangError("/generate", 400, "the input is 5000 tokens"), "yes"])
    with pytest.raises(RewardError, match="refused the request: HTTP 400: 'the input is 5000 tokens'"):
        await reward.score(row(), "41")
    assert len(client.requests) == 1


async def test_a_judge_past_its_time_limit_is_a_timeout():
    reward, client = judge(["hang", "hang"], timeout_s=0.05, retries=1)
    with pytest.raises(RewardError, match=r"failed 2 time\(s\); last: no answer within 0.05s") as e:
        await reward.score(row(), "41")
    assert e.value.kind == "timeout"


async def test_an_unparsable_answer_is_a_counted_failure():
    reward, _ = judge(["maybe"])
    before = unparsed()
    with pytest.raises(RewardError, match="parser yes_no found no reward in its answer 'maybe'"):
        await reward.score(row(), "41")
    assert unparsed() == before + 1


async def test_an_unparsable_answer_scores_the_default_when_one_is_set():
    reward, _ = judge(["maybe"], default=0.25)
    before = unparsed()
    assert await reward.score(row(), "41") == 0.25
    assert unparsed() == before + 1


def test_an_unnamed_judge_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"names judge engine 'other', which the rollout's --judge-urls"):
        build_reward("model:other", judge_urls={"judge": "http://judge:1"})


# ------------------------------------------------------------------------------------- in the rollout role


class ParityJudge(ScriptedJudge):
    """Judges by the response's length: "yes" when even; the template puts the response between [ and ]."""

    def __init__(self):
        super().__init__([])

    async def generate_text(self, text, sampling_params):
        self.requests.append((text, sampling_params))
        response = text[text.index("[") + 1 : text.rindex("]")]
        return " Yes" if len(response) % 2 == 0 else " no, wrong"


def test_the_rollout_writes_the_judges_verdicts_as_rewards(model_dir, prompts, tokenizer):
    from tests.rollout.rollout_harness import N, PROMPTS, Rollout, expected_response, make_run

    run = make_run(model_dir, prompts, num_steps=2)
    settings = {"reward": "model:http://judge:9", "judge": {"template": "{prompt} -> [{response}] label {label}?"}}
    r = Rollout(type(run).model_validate({**run.model_dump(), "rollout": {**run.rollout.model_dump(), **settings}}))
    client = r.judge_client = ParityJudge()
    r.go()

    groups = r.groups()
    assert sorted(groups) == [0, 1, 2, 3]
    verdicts = set()
    for position, rows in groups.items():
        for k, row in enumerate(rows):
            text = tokenizer.decode(expected_response(position, k)[1], skip_special_tokens=True)
            verdicts.add(float(row["reward"]))
            assert float(row["reward"]) == (1.0 if len(text) % 2 == 0 else 0.0)
            assert (
                f"{PROMPTS[position % len(PROMPTS)]} -> [{text}] label {position % len(PROMPTS)}?",
                {"max_new_tokens": 16, "temperature": 0.0},
            ) in client.requests
    assert verdicts == {0.0, 1.0}  # the judge told samples apart
    assert len(client.requests) == len(groups) * N and client.url == "http://judge:9" and client.closed
