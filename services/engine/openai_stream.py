"""Server-sent events of /v1/completions and /v1/chat/completions with `stream: true`, in OpenAI's chunk shapes.

Each event carries, per sample, the text new since its last event. Text that may still change is held back
until it cannot: a trailing partial UTF-8 character, the start of a stop string (the finished text is cut
before it), and, when tools are offered, what may be a tool call in the template's format (from its marker
on: services/model/tool_call_formats.py), which goes out parsed as a `tool_calls` delta when the sample
finishes. The last event of a sample carries its finish reason (and, when asked for, SGLang's
token ids and meta info); with `stream_options.include_usage` a last chunk carries the usage. A client that
goes away has its unfinished samples aborted."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi.responses import StreamingResponse

from services.engine.generate_routes import abort_unfinished, meta_info
from services.engine.request import Generation
from services.model.tool_call_formats import parse_tool_calls, tool_call_format
from services.openai_api.models import tool_calls


def settled_text(engine, seq: Generation, hold: list[str]) -> str:
    """The sample's text as far as it can no longer change."""
    if seq.finished:
        return seq.text
    text = engine.tokenizer.decode(seq.output, skip_special_tokens=True).rstrip("\ufffd")
    for s in hold:
        at = text.find(s)
        if at >= 0:  # a whole one (a stop string the engine is about to cut at, or a tool call)
            text = text[:at]
    for s in hold:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                text = text[:-k]
                break
    return text


class Samples:
    """Per sample: how much text and how many tokens went out."""

    def __init__(self, engine, seqs: list[Generation], hold: list[str]):
        self.engine, self.seqs, self.hold = engine, seqs, hold
        self.chars, self.tokens = [0] * len(seqs), [0] * len(seqs)

    def new_text(self, i: int) -> str:
        text = settled_text(self.engine, self.seqs[i], self.hold)
        out = text[self.chars[i] :]
        self.chars[i] = max(self.chars[i], len(text))
        return out

    def new_tokens(self, i: int) -> range:
        seq = self.seqs[i]
        start, self.tokens[i] = self.tokens[i], len(seq.logprobs)
        return range(start, self.tokens[i])


async def updates(seqs: list[Generation], queues: list[asyncio.Queue]):
    """(index, finished) each time a sample has news, until every sample finished."""
    pending = set(range(len(seqs)))
    while pending:
        for i in sorted(pending):
            await queues[i].get()
            done = seqs[i].finished  # read before the chunk: a later finish sends another update
            yield i, done
            if done:
                pending.discard(i)


def _sse(engine, seqs, body) -> StreamingResponse:
    async def events():
        try:
            async for chunk in body:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away: what is left stops taking KV slots
            abort_unfinished(engine, seqs)

    return StreamingResponse(events(), media_type="text/event-stream")


def token_usage(seqs: list[Generation], prompts: list[list[int]]) -> dict:
    """OpenAI's usage: each prompt counted once (not once per sample), every sample's output."""
    p, c = sum(len(x) for x in prompts), sum(len(s.output) for s in seqs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _extras(engine, req, seq: Generation, prompt: list[int]) -> dict:
    out: dict[str, Any] = {}
    if getattr(req, "return_token_ids", False) or getattr(req, "return_prompt_token_ids", False):
        out.update(token_ids=list(seq.output), prompt_token_ids=prompt)
    if req.return_meta_info:
        out["meta_info"] = meta_info(seq, engine.scheduler.weight_version)
    return out


def completion_events(engine, req, seqs, queues, prompts, response_id: str) -> StreamingResponse:
    head = {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": req.model}
    samples = Samples(engine, seqs, [s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or [])])
    tok = engine.tokenizer

    async def body():
        async for i, done in updates(seqs, queues):
            seq, new = seqs[i], samples.new_tokens(i)
            choice = {"index": i, "text": samples.new_text(i), "logprobs": None, "finish_reason": None}
            if req.logprobs is not None:
                choice["logprobs"] = {
                    "tokens": [tok.decode([seq.output[k]]) for k in new],
                    "token_logprobs": [seq.logprobs[k] for k in new],
                    "top_logprobs": [{tok.decode([t]): lp for lp, t in seq.top_logprobs[k]} for k in new]
                    if seq.top_logprobs_num
                    else None,
                    "text_offset": [],
                }
            if done:
                choice.update(finish_reason=seq.finish_reason["type"], **_extras(engine, req, seq, prompts[i // req.n]))
            yield {**head, "choices": [choice]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": token_usage(seqs, prompts)}

    return _sse(engine, seqs, body())


def chat_logprobs(engine, seq: Generation, new: range) -> dict:
    """OpenAI's chat `logprobs` of the sample's output tokens at positions `new`."""

    def entry(token: int, lp: float) -> dict:
        piece = engine.tokenizer.decode([token])
        return {"token": piece, "bytes": list(piece.encode()), "logprob": lp}

    return {
        "content": [
            {
                **entry(seq.output[k], seq.logprobs[k]),
                "top_logprobs": [entry(t, lp) for lp, t in (seq.top_logprobs[k] if seq.top_logprobs_num else [])],
            }
            for k in new
        ]
    }


def _final_chat_delta(samples: Samples, i: int, tools: bool, rid: str) -> tuple[dict, str]:
    """The last delta of sample i (the rest of its text, its parsed tool calls) and its finish reason."""
    seq = samples.seqs[i]
    assert seq.finish_reason is not None  # sample i is done
    reason = seq.finish_reason["type"]
    if not tools:
        return {"content": samples.new_text(i)}, reason
    content, calls = parse_tool_calls(seq.text, tool_call_format(samples.engine.tokenizer))
    sent = samples.chars[i]
    delta: dict[str, Any] = {"content": (content or "")[sent:]}
    if calls:  # so tool_calls gives a list, not None
        delta["tool_calls"] = [
            {"index": k, **c.model_dump()} for k, c in enumerate(tool_calls(f"{rid}_{i}", calls) or [])
        ]
        reason = "tool_calls" if reason == "stop" else reason
    return delta, reason


def chat_events(engine, req, seqs, queues, prompt: list[int], response_id: str) -> StreamingResponse:
    head = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model}
    tools = bool(req.tools) and req.tool_choice != "none"
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    fmt = tool_call_format(engine.tokenizer)
    samples = Samples(engine, seqs, stops + (list(fmt.hold) if tools and fmt else []))
    rid = response_id.removeprefix("chatcmpl-")

    async def body():
        for i in range(len(seqs)):
            yield {
                **head,
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
            }
        async for i, done in updates(seqs, queues):
            new = samples.new_tokens(i)
            choice = {"index": i, "delta": None, "logprobs": None, "finish_reason": None}
            if done:
                choice["delta"], choice["finish_reason"] = _final_chat_delta(samples, i, tools, rid)
                choice.update(_extras(engine, req, seqs[i], prompt))
            else:
                choice["delta"] = {"content": samples.new_text(i)}
            if req.logprobs:
                choice["logprobs"] = chat_logprobs(engine, seqs[i], new)
            yield {**head, "choices": [choice]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": token_usage(seqs, [prompt])}

    return _sse(engine, seqs, body())
