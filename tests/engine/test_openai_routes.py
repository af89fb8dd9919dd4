"""The engine's OpenAI-compatible routes, driven by the `openai` package's own client against a real engine
process (with a token, which the client sends as its API key). The model is the tiny Qwen2 taught, in a few
seconds of supervised steps, to answer one question with a call of the `add` tool, so tool-call parsing is
exercised on what the model really wrote."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.model.chat_format import render_chat, turn_end_ids
from tests.engine.conftest import ADD, CALL, QUESTION, start_engine

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

TOKEN = "openai-routes-token"


@pytest.fixture(scope="module")
def served(tool_model, tmp_path_factory):
    proc, url = start_engine(tool_model[0], tmp_path_factory.mktemp("engine"), token=TOKEN)
    client = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    yield client, url, tool_model[1]
    client.close()
    proc.stop()


def test_models_lists_the_served_model(served, tool_model):
    client, _, _ = served
    models = client.models.list().data
    assert [m.id for m in models] == [tool_model[0]]


def test_chat_completion_returns_exact_tokens_and_the_weight_version(served):
    client, url, tok = served
    out = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=12,
        temperature=0,
        extra_body={"return_prompt_token_ids": True, "return_meta_info": True},
    )
    choice = out.choices[0]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == render_chat(tok, [{"role": "user", "content": "hello there"}])
    assert len(extra["token_ids"]) == out.usage.completion_tokens <= 12
    assert choice.message.content == tok.decode(extra["token_ids"], skip_special_tokens=True)
    served_version = httpx.get(url + "/weight_version", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert extra["meta_info"]["weight_version"] == served_version["weight_version"]
    assert out.usage.prompt_tokens == len(extra["prompt_token_ids"])
    # the same tokens as /generate greedy on the same prompt ids, stopping at the end of the turn
    native = httpx.post(
        url + "/generate",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={
            "input_ids": extra["prompt_token_ids"],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": turn_end_ids(tok)},
        },
    ).json()
    assert native["output_ids"] == extra["token_ids"]


def test_tools_are_rendered_and_the_models_call_is_parsed(served):
    client, _, tok = served
    out = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        tools=[ADD],
        temperature=0,
        max_tokens=100,
        extra_body={"return_prompt_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.model_extra["prompt_token_ids"] == render_chat(tok, QUESTION, [ADD])
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert call.function.arguments == '{"a": 2, "b": 3}'
    # the tool's result goes back as a tool message: rendered by the template after the assistant's call
    follow = QUESTION + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    again = client.chat.completions.create(
        model="m",
        messages=follow,
        tools=[ADD],
        temperature=0,
        max_tokens=4,
        extra_body={"return_prompt_token_ids": True},
    )
    prompt = again.choices[0].model_extra["prompt_token_ids"]
    assert prompt == render_chat(tok, follow, [ADD])
    assert tok.decode(prompt).endswith(
        CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # tool_choice "none": the tools are not offered and nothing is parsed
    plain = client.chat.completions.create(
        model="m", messages=QUESTION, tools=[ADD], tool_choice="none", temperature=0, max_tokens=8
    )
    assert plain.choices[0].message.tool_calls is None


def test_n_samples_with_a_seed_and_logprobs(served):
    client, _, _ = served
    kwargs = dict(
        model="m",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=6,
        temperature=1.0,
        n=3,
        seed=11,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_meta_info": True},
    )
    out = client.chat.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        native = c.model_extra["meta_info"]["output_token_logprobs"]
        assert [t.logprob for t in c.logprobs.content] == pytest.approx([lp for lp, _, _ in native])
        assert all(
            len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in c.logprobs.content
        )
    again = client.chat.completions.create(**kwargs)  # the seed makes each sample reproducible
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_streamed_chat_equals_the_whole_answer(served):
    client, _, _ = served
    kwargs = dict(model="m", messages=[{"role": "user", "content": "tell me"}], max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    calls = list(
        client.chat.completions.create(
            model="m", messages=QUESTION, tools=[ADD], temperature=0, max_tokens=100, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in calls]
    assert "".join(d.content or "" for d in deltas) == ""  # the call is not streamed as text
    [call] = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert call.function.name == "add" and calls[-1].choices[0].finish_reason == "tool_calls"


def test_text_completions_batch_tokens_and_stream(served):
    client, _, tok = served
    out = client.completions.create(
        model="m",
        prompt=["one two", "three"],
        max_tokens=5,
        temperature=0,
        n=2,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        ids = c.model_extra["token_ids"]
        assert c.text == tok.decode(ids, skip_special_tokens=True) and len(c.logprobs.token_logprobs) == len(ids)
        assert "".join(c.logprobs.tokens) == tok.decode(ids)
    assert out.choices[0].model_extra["prompt_token_ids"] == tok.encode("one two", add_special_tokens=False)
    assert out.choices[2].text == out.choices[3].text  # greedy: both samples of "three" agree
    streamed = list(client.completions.create(model="m", prompt="one two", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_bad_requests_get_400_and_no_token_401(served):
    client, url, _ = served
    for kwargs in (
        dict(messages=[]),
        dict(messages=QUESTION, n=0),
        dict(messages=QUESTION, top_logprobs=99),
        dict(messages=QUESTION, extra_body={"no_such_field": 1}),
        dict(messages=[{"role": "wizard", "content": "x"}]),
    ):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", **kwargs)
    for kwargs in (dict(prompt=[10**9]), dict(prompt="x", extra_body={"top_k": 0})):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", max_tokens=1, **kwargs)
    anonymous = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert client.models.list().data  # the engine is still serving
