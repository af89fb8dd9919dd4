"""A model as the reward against a real built-in engine process serving a tiny random model as the judge: its
greedy answer to the rendered prompt is parsed into the reward (a random model's answer holds no verdict, so
rollout.judge.default scores it: a deterministic, checkable result), the run's token is required, and an engine
that is not there fails after the retries."""

from __future__ import annotations

import pytest

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards import RewardError, build_reward
from services.rollout.rewards.model_judge import parse_answer, render_prompt
from services.run_contract.judge_settings import JudgeSettings
from services.runtime.processes import free_port
from services.sglang_protocol.client import SGLangClient
from tests.engine.conftest import start_engine

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

TOKEN = "judge-test-token"
TEMPLATE = "Question: {prompt}\nAnswer: {response}\nExpected: {label}\nCorrect? Reply yes or no.\n"
RECORD = PromptRecord(position=0, epoch=0, index=0, prompt="What is 6 x 7?", fields={"label": "42"})


@pytest.fixture(scope="module")
def judge_url(tiny_model_dir, tmp_path_factory):
    proc, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("judge"), token=TOKEN)
    yield url
    proc.stop()


async def greedy_answer(url: str, text: str, max_new_tokens: int) -> str:
    client = SGLangClient(url, api_key=TOKEN)
    try:
        return await client.generate_text(text, {"max_new_tokens": max_new_tokens, "temperature": 0.0})
    finally:
        await client.aclose()
        client.close()


async def judged(url: str, response: str, key: str | None = TOKEN, **settings) -> float:
    reward = build_reward(
        "model:judge",
        judge_urls={"judge": url},
        engine_key=key,
        timeout_s=30,
        retries=1,
        judge=JudgeSettings(template=TEMPLATE, max_new_tokens=12, **settings),
    )
    try:
        return await reward.score(RECORD, response)
    finally:
        await reward.aclose()


async def test_the_judges_greedy_answer_is_parsed_into_the_reward(judge_url):
    answer = await greedy_answer(judge_url, render_prompt(TEMPLATE, RECORD, "It is 42."), 12)
    assert answer and parse_answer(answer, r"regex:VERDICT=(\d+)") is None  # random text: no verdict in it
    # the documented way to run a random judge: a parser that finds nothing, and the default it then scores
    assert await judged(judge_url, "It is 42.", parser=r"regex:VERDICT=(\d+)", default=0.25) == 0.25
    # the same answer (greedy) through yes_no: what the parser makes of it, or the default
    expected = parse_answer(answer, "yes_no")
    assert await judged(judge_url, "It is 42.", default=0.5) == (0.5 if expected is None else expected)


async def test_without_a_default_an_answer_without_a_verdict_fails(judge_url):
    with pytest.raises(RewardError, match=r"parser regex:VERDICT=\(\\d\+\) found no reward in its answer"):
        await judged(judge_url, "It is 42.", parser=r"regex:VERDICT=(\d+)")


async def test_the_judge_engine_requires_the_token(judge_url):
    with pytest.raises(RewardError, match="refused the request: HTTP 401"):
        await judged(judge_url, "It is 42.", key="wrong-token", default=0.25)


async def test_a_prompt_over_the_judges_context_is_refused_at_once(judge_url):
    with pytest.raises(RewardError, match="refused the request: HTTP 400"):
        await judged(judge_url, "forty two " * 20000, default=0.25)


async def test_an_engine_that_is_not_there_fails_after_the_retries():
    with pytest.raises(RewardError, match=r"failed 2 time\(s\); last: ClientConnectorError"):
        await judged(f"http://127.0.0.1:{free_port()}", "It is 42.", default=0.25)
