"""A whole chat completion as OpenAI's server-sent events (`stream: true`), for a server that has the answer
before it replies: per choice a first chunk with the role, then one with the content, the tool calls (as a
`tool_calls` delta, each with its index) and the finish reason (and SGLang's token ids and meta info when the
choice has them); a usage chunk when asked for; then `[DONE]`. The `openai` client's streaming reads it as it
reads an incremental stream."""

from __future__ import annotations

import json
from typing import Iterator

from services.openai_api.models import ChatCompletionResponse

_EXTRAS = ("prompt_token_ids", "token_ids", "meta_info")


def chat_chunks(response: ChatCompletionResponse, include_usage: bool = False) -> Iterator[dict]:
    head = {"id": response.id, "object": "chat.completion.chunk", "created": response.created, "model": response.model}
    for choice in response.choices:
        yield {
            **head,
            "choices": [
                {
                    "index": choice.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        delta: dict[str, object] = {"content": choice.message.content or ""}
        if choice.message.tool_calls:
            delta["tool_calls"] = [
                {"index": k, **call.model_dump()} for k, call in enumerate(choice.message.tool_calls)
            ]
        last = {
            "index": choice.index,
            "delta": delta,
            "finish_reason": choice.finish_reason,
            "logprobs": choice.logprobs.model_dump() if choice.logprobs else None,
        }
        last.update({k: getattr(choice, k) for k in _EXTRAS if getattr(choice, k) is not None})
        yield {**head, "choices": [last]}
    if include_usage:
        yield {**head, "choices": [], "usage": response.usage.model_dump()}


def sse_lines(chunks: Iterator[dict]) -> Iterator[str]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
