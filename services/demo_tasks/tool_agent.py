"""demo:tool's agent: add two numbers with an `add` tool, in plain `openai` client code (rollout.agent:
import:services.demo_tasks.tool_agent:solve). The model sees the question and the tool; if it calls the tool,
the agent runs it and sends the result back; the model's last reply is its answer, which the run's reward
(`arith`: the number must equal the row's label) scores. This is the whole contract of an agent
(docs/agents.md): take the sample and a client, talk to the model, return a reward or None."""

from __future__ import annotations

import json

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def add(a: int, b: int) -> int:
    return a + b


def solve(sample: dict, client) -> float | None:
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(3):  # at most two tool rounds, then the answer
        reply = (
            client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=48)
            .choices[0]
            .message
        )
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return None  # the run's reward scores this last reply
        for call in reply.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(add(int(args["a"]), int(args["b"])))
            except (ValueError, KeyError, TypeError) as exc:  # a malformed call: the model reads the error
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0  # never answered
