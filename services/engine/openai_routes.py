"""GET /v1/models, POST /v1/completions and /v1/chat/completions: OpenAI's API over the engine's scheduler.

A request becomes the same Generations a /generate does (the n samples of a prompt share its prefill), so
pause modes, abort by rid, weight updates and per-token version spans behave as there. Chat messages are
rendered with the model's chat template (services/model/chat_format.py); a chat completion also stops at
the template's end-of-turn token. Answers are OpenAI's shapes; SGLang's extensions add the exact token ids
(`return_token_ids`, `return_prompt_token_ids`) and /generate's meta info (`return_meta_info`: weight
version, its spans over the output, log-probs) to each choice. Streaming is openai_stream.py."""

from __future__ import annotations

import time
from typing import Any, Sequence

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from services.engine.generate_routes import (
    BadRequest,
    abort_unfinished,
    check_capacity,
    check_prompt_ids,
    meta_info,
    samples_of,
    wait_all,
)
from services.openai_api.models import (
    MAX_STOPS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    tool_calls,
)
from services.engine.openai_stream import chat_events, chat_logprobs, completion_events, token_usage
from services.engine.request import Generation, new_rid, share_prompts
from services.engine.sampling import SamplingParams
from services.model.chat_format import ChatFormatError, render_chat, turn_end_ids
from services.model.tool_call_formats import parse_tool_calls, tool_call_format

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "a body the engine cannot serve"},
    503: {"description": "the queue is full, or the engine failed"},
}


def sampling_params(req, max_new_tokens: int, extra_stop_ids: Sequence[int] = ()) -> SamplingParams:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop strings")
    stop_ids = list(req.stop_token_ids or []) + [i for i in extra_stop_ids if not req.ignore_eos]
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            stop=stops or None,
            stop_token_ids=stop_ids or None,
            ignore_eos=req.ignore_eos,
            min_new_tokens=req.min_tokens,
            n=req.n,
            sampling_seed=req.seed,
        )
    except ValidationError as exc:  # what the engine's sampler refuses (top_k 0): 400 naming it
        raise BadRequest("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])) from None


def completion_prompts(engine, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.tokenizer.encode(prompt, add_special_tokens=False)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


def chat_prompt(engine, req: ChatCompletionRequest) -> list[int]:
    tools = None
    if req.tools and req.tool_choice != "none":
        if tool_call_format(engine.tokenizer) is None:
            raise BadRequest("tools: the model's chat template defines no tool-call format")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        return render_chat(
            engine.tokenizer,
            [m.model_dump(exclude_none=True) for m in req.messages],
            tools,
            **(req.chat_template_kwargs or {}),
        )
    except ChatFormatError as exc:
        raise BadRequest(str(exc)) from None


def start(engine, prompts: list[list[int]], params: SamplingParams, rid: str, stream: bool, top_n: int):
    """Queue the samples of `prompts` (OpenAI's choice order: prompt by prompt, n each); -> them and their queues."""
    check_prompt_ids(engine, prompts)
    items = [(p, params, rid if len(prompts) == 1 else f"{rid}-p{i}") for i, p in enumerate(prompts)]
    check_capacity(engine, items)
    seqs, queues = samples_of(engine, items, stream, [(True, top_n, -1)] * len(items))  # meta_info: log-probs
    for group in share_prompts(seqs):
        engine.scheduler.submit(group)
    return seqs, queues


async def finished(request: Request, engine, seqs, queues) -> bool:
    """Wait for every sample; False (each aborted) if the client went away first."""
    if not await wait_all(request, seqs, queues):
        abort_unfinished(engine, seqs)
        return False
    return True


def finish_reason(seq: Generation) -> str | None:
    return None if seq.finish_reason is None else seq.finish_reason["type"]


def matched(seq: Generation):
    return (seq.finish_reason or {}).get("matched")


def completion_logprobs(engine, seq: Generation) -> CompletionLogprobs:
    pieces = [engine.tokenizer.decode([t]) for t in seq.output]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    tops = (
        [{engine.tokenizer.decode([t]): lp for lp, t in step} for step in seq.top_logprobs]
        if seq.top_logprobs_num
        else None
    )
    return CompletionLogprobs(tokens=pieces, token_logprobs=list(seq.logprobs), top_logprobs=tops, text_offset=offsets)


def completion_choice(
    engine, req: CompletionRequest, seq: Generation, index: int, prompt: list[int]
) -> CompletionChoice:
    return CompletionChoice(
        index=index,
        text=seq.text,
        logprobs=completion_logprobs(engine, seq) if req.logprobs is not None else None,
        finish_reason=finish_reason(seq),
        matched_stop=matched(seq),
        token_ids=list(seq.output) if req.return_token_ids else None,
        prompt_token_ids=prompt if req.return_token_ids else None,
        meta_info=meta_info(seq, engine.scheduler.weight_version) if req.return_meta_info else None,
    )


def chat_token_limit(engine, req: ChatCompletionRequest, prompt: list[int]) -> int:
    """The chat completion's max_new_tokens: max_completion_tokens, else max_tokens, else OpenAI's default."""
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is None:  # OpenAI's default: what the context leaves
        limit = min(engine.config.max_new_tokens_limit or engine.pool.slot_len, engine.pool.slot_len - len(prompt))
    return max(limit, 0)


def chat_choice(
    engine, req: ChatCompletionRequest, seq: Generation, index: int, prompt: list[int], rid: str
) -> ChatChoice:
    content, calls = (
        parse_tool_calls(seq.text, tool_call_format(engine.tokenizer))
        if req.tools and req.tool_choice != "none"
        else (seq.text, [])
    )
    reason = "tool_calls" if calls and finish_reason(seq) == "stop" else finish_reason(seq)
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=content, tool_calls=tool_calls(f"{rid}_{index}", calls)),
        logprobs=ChoiceLogprobs(**chat_logprobs(engine, seq, range(len(seq.logprobs)))) if req.logprobs else None,
        finish_reason=reason,
        matched_stop=matched(seq),
        prompt_token_ids=prompt if req.return_prompt_token_ids or req.return_token_ids else None,
        token_ids=list(seq.output) if req.return_token_ids or req.return_prompt_token_ids else None,
        meta_info=meta_info(seq, engine.scheduler.weight_version) if req.return_meta_info else None,
    )


def openai_router(engine) -> APIRouter:
    router = APIRouter(tags=["openai"])
    created = int(time.time())

    @router.get("/v1/models", response_model=ModelList)
    async def models():
        """The one model this engine serves (any `model` name in a request reaches it)."""
        return ModelList(
            data=[
                ModelCard(
                    id=engine.config.model,
                    created=created,
                    root=engine.config.model,
                    max_model_len=engine.pool.slot_len,
                )
            ]
        )

    @router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        """Text completions (one prompt or a batch, `n` samples each)."""
        if req.echo:
            raise BadRequest("echo is not supported")
        prompts, rid = completion_prompts(engine, req.prompt), req.rid or new_rid()
        seqs, queues = start(engine, prompts, sampling_params(req, req.max_tokens), rid, req.stream, req.logprobs or 0)
        if req.stream:
            return completion_events(engine, req, seqs, queues, prompts, f"cmpl-{rid}")
        if not await finished(request, engine, seqs, queues):
            return Response(status_code=499)
        choices = [completion_choice(engine, req, s, i, prompts[i // req.n]) for i, s in enumerate(seqs)]
        return CompletionResponse(
            id=f"cmpl-{rid}", model=req.model, choices=choices, usage=Usage(**token_usage(seqs, prompts))
        )

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        """Chat completions: the messages (and tools) through the model's chat template; tool calls parsed
        from the reply in the template's format."""
        prompt, rid = chat_prompt(engine, req), req.rid or new_rid()
        params = sampling_params(req, chat_token_limit(engine, req, prompt), turn_end_ids(engine.tokenizer))
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        seqs, queues = start(engine, [prompt], params, rid, req.stream, top_n)
        if req.stream:
            return chat_events(engine, req, seqs, queues, prompt, f"chatcmpl-{rid}")
        if not await finished(request, engine, seqs, queues):
            return Response(status_code=499)
        choices = [chat_choice(engine, req, s, i, prompt, rid) for i, s in enumerate(seqs)]
        return ChatCompletionResponse(
            id=f"chatcmpl-{rid}", model=req.model, choices=choices, usage=Usage(**token_usage(seqs, [prompt]))
        )

    return router
