"""A scripted agent for tests/rollout/test_agent_rollout.py (rollout.agent: import:tests.rollout.scripted_agent:
agent), written against the plain `openai` client: it calls the `add` tool, sends the result back, then rewrites
its history (a summary instead of the tool exchange) and asks once more. What each call returned is kept in
CALLS (the test runs the rollout in its own process)."""

from __future__ import annotations

import json

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CALLS: dict[tuple[int, int], list[dict]] = {}
BEFORE_LAST_CALL: list = []  # callables a test runs before each episode's last call (a weight update there)


def agent(sample, client):
    question = [{"role": "user", "content": sample["prompt"]}]
    calls = []

    def ask(messages, max_tokens=8, **kwargs):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens, **kwargs)
        calls.append(
            {
                "messages": messages,
                **reply.choices[0].model_extra,
                "finish_reason": reply.choices[0].finish_reason,
                "tool_calls": reply.choices[0].message.tool_calls,
            }
        )
        return reply.choices[0].message

    first = ask(question, max_tokens=100, tools=[ADD])
    if first.tool_calls:  # run the tool; its result goes back as a tool message
        call = first.tool_calls[0]
        args = json.loads(call.function.arguments)
        result = {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
    else:
        result = {"role": "tool", "tool_call_id": "none", "content": "no call"}
    ask(question + [first.model_dump(exclude_none=True), result], tools=[ADD])
    summary = [{"role": "system", "content": f"The tool said {result['content']}."}] + question  # a rewrite
    third = ask(summary)
    for hook in BEFORE_LAST_CALL:
        hook()
    ask(summary + [third.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}])
    CALLS[(sample["position"], sample["index"])] = calls
    return 1.0 if first.tool_calls else 0.0
