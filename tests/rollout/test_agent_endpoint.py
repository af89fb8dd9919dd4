"""The rollout's per-episode endpoint (services/rollout/agent_endpoint.py) in the role's real status app, its
generation a fake: each episode answers only to its own key (not the stack's token, which does not open it),
limits answer 400 naming them and record the outcome, and a body it cannot serve changes nothing; `n` completions
are n turns, and a streamed call reaches the `openai` client as its chunks."""

from __future__ import annotations

import openai
from fastapi.testclient import TestClient

from services.model.chat_format import render_chat
from services.rollout.agent_endpoint import EpisodeLimits, Episodes
from services.rollout.engine_pool import SampleOutput
from services.role.role_service import RoleStatus, build_status_app

STACK = "stack-token"


def setup(tokenizer, limits: EpisodeLimits):
    episodes, calls = Episodes(), []

    async def generate(prompt, sampling, max_new_tokens, rid):
        calls.append((prompt, sampling, max_new_tokens))
        out = SampleOutput()
        out.append([5, 6], [-0.1, -0.2], [("3", 0, 2)])
        out.finish_reason = "length"
        return out

    episodes.attach(generate, tokenizer, {"temperature": 0.7, "top_p": 1.0, "top_k": -1}, limits, "m")
    app = build_status_app(RoleStatus("rollout"), STACK, [episodes.router()])
    return episodes, calls, TestClient(app)


def ask(http, episode, key, **body):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return http.post(
        f"/episodes/{episode.id}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


def test_an_episode_answers_only_to_its_own_key(tokenizer):
    episodes, calls, http = setup(tokenizer, EpisodeLimits())
    mine, other = episodes.open("a"), episodes.open("b")
    assert http.get("/status").status_code == 401  # the stack's token still guards the rest
    for key in (STACK, other.key, ""):
        assert ask(http, mine, key).status_code == 401
    assert calls == [] and mine.turns == []
    reply = ask(http, mine, mine.key, max_tokens=4, temperature=0.0).json()
    prompt, sampling, max_new = calls[0]
    assert prompt == render_chat(tokenizer, [{"role": "user", "content": "hi"}]) and max_new == 4
    assert sampling["temperature"] == 0.7  # the run's sampling, not the call's
    assert reply["choices"][0]["token_ids"] == [5, 6] and reply["choices"][0]["meta_info"]["weight_version"] == "3"
    assert mine.turns[0].versions == [3, 3] and mine.turns[0].log_probs == [-0.1, -0.2]
    episodes.close(mine)
    assert ask(http, mine, mine.key).status_code == 401  # a closed episode takes no more calls


def test_limits_answer_400_naming_them_and_record_the_outcome(tokenizer):
    episodes, calls, http = setup(tokenizer, EpisodeLimits(max_turns=2, max_tokens=10_000))
    ep = episodes.open("a")
    assert ask(http, ep, ep.key).status_code == 200 and ask(http, ep, ep.key).status_code == 200
    third = ask(http, ep, ep.key)
    assert third.status_code == 400 and "turn_limit" in third.text and ep.outcome == "turn_limit"
    short = episodes.open("b")
    episodes.limits = EpisodeLimits(max_turns=5, max_tokens=3)
    refused = ask(http, short, short.key)
    assert refused.status_code == 400 and "token_limit" in refused.text and short.turns == []
    for body in ({"n": 6}, {"messages": []}, {"n": 0}):
        fresh = episodes.open("c")
        assert ask(http, fresh, fresh.key, **body).status_code in (400, 422) and fresh.turns == []
    assert len(calls) == 2


def _answers(tokenizer):
    """Episodes whose fake engine answers completion i of a call with the i-th of two replies."""
    replies = [tokenizer.encode(t, add_special_tokens=False) for t in ("yes it is", "no it is not")]
    episodes = Episodes()

    async def generate(prompt, sampling, max_new_tokens, rid):
        out = SampleOutput()
        ids = replies[int(rid.rsplit("-", 1)[1]) if rid.count("-") > 2 else 0]
        out.append(ids, [-0.5] * len(ids), [("1", 0, len(ids))])
        out.finish_reason = "stop"
        return out

    episodes.attach(generate, tokenizer, {"temperature": 1.0}, EpisodeLimits(), "m")
    http = TestClient(build_status_app(RoleStatus("rollout"), STACK, [episodes.router()]))
    return episodes, http, replies


def test_n_completions_are_n_turns_and_the_next_call_continues_the_one_sent_back(tokenizer):
    episodes, http, replies = _answers(tokenizer)
    ep = episodes.open("a")
    question = [{"role": "user", "content": "hi"}]
    reply = ask(http, ep, ep.key, n=2).json()
    assert [c["token_ids"] for c in reply["choices"]] == replies and [c["index"] for c in reply["choices"]] == [0, 1]
    assert [t.output_ids for t in ep.turns] == replies and reply["usage"]["completion_tokens"] == sum(map(len, replies))
    chosen = reply["choices"][1]["message"]
    ask(http, ep, ep.key, messages=question + [chosen, {"role": "user", "content": "sure?"}])
    third = ep.turns[2]
    assert third.prompt_ids[: len(ep.turns[1].prompt_ids) + len(replies[1])] == ep.turns[1].prompt_ids + replies[1]


def test_a_streamed_call_is_the_whole_answer_in_chunks_for_the_openai_client(tokenizer):
    episodes, http, replies = _answers(tokenizer)
    ep = episodes.open("a")
    client = openai.OpenAI(base_url=f"http://testserver/episodes/{ep.id}/v1", api_key=ep.key, http_client=http)
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == tokenizer.decode(replies[0])
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "stop"]
    assert chunks[-1].usage.completion_tokens == len(replies[0])
    assert chunks[-2].choices[0].model_extra["token_ids"] == replies[0]
    assert len(ep.turns) == 2  # each call recorded once


def test_an_answer_with_tool_calls_starts_the_tool_wait_and_the_next_call_ends_it(tokenizer):
    call = tokenizer.encode('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', add_special_tokens=False)
    episodes = Episodes()

    async def generate(prompt, sampling, max_new_tokens, rid):
        out = SampleOutput()
        out.append(call, [-0.5] * len(call), [("0", 0, len(call))])
        out.finish_reason = "stop"
        return out

    episodes.attach(generate, tokenizer, {"temperature": 1.0}, EpisodeLimits(), "m")
    http = TestClient(build_status_app(RoleStatus("rollout"), STACK, [episodes.router()]))
    ep = episodes.open("a")
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    plain = ask(http, ep, ep.key).json()  # no tools offered: the same text is not a call
    assert plain["choices"][0]["message"].get("tool_calls") is None and ep.tool_wait_since is None
    reply = ask(http, ep, ep.key, tools=[tool]).json()
    assert reply["choices"][0]["finish_reason"] == "tool_calls" and ep.tool_wait_since is not None
    ask(http, ep, ep.key)
    assert ep.tool_wait_since is None
