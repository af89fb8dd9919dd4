"""POST /generate and /abort_request: SGLang's generation routes over the engine's scheduler.

A running engine answers POST /generate on its lane (generate_lane.py), with the same `answer_generate`; the
FastAPI route here describes it in the OpenAPI document and serves it where the app runs without the lane."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Mapping, Sequence, cast

import orjson
import torch
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter

from services.engine.protocol import AbortRequest, GenerateRequest, GenerateResult
from services.engine.request import Generation, new_rid, share_prompts
from services.engine.sampling import SamplingParams

TOKENS_OUT = Counter("sluice_engine_generated_tokens_total", "tokens generated")
REQUESTS = Counter("sluice_engine_requests_total", "generate requests", ["finish"])


# how often a non-streaming request that waits checks whether its client is still there
DISCONNECT_CHECK_S = 1.0


def error_response(message: str, status: int = 400, headers: dict | None = None) -> JSONResponse:
    """SGLang's error body: {"error": {"message": ...}}."""
    return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)


def refusal(exc: "BadRequest | Unavailable") -> JSONResponse:
    """A refused /generate's answer: 400 with the message, or 503 with Retry-After when the engine is full or
    failed (the app's exception handlers and the lane both answer with it)."""
    if isinstance(exc, Unavailable):
        return error_response(str(exc), 503, {"Retry-After": "1"})
    return error_response(str(exc))


class BadRequest(ValueError):
    """A well-formed body the engine cannot serve (server.py answers 400 with the message)."""


class Unavailable(RuntimeError):
    """The engine cannot take the request now: its queue is full, or it failed (server.py answers 503)."""


def check_capacity(engine, items) -> None:
    """Refuse, before anything is queued, what is over the engine's limits (--max-new-tokens-limit,
    --max-queued-requests) or arrives after the engine failed or while its memory is released."""
    config, sched = engine.config, engine.scheduler
    limit = config.max_new_tokens_limit or engine.pool.slot_len
    if any(params.max_new_tokens > limit for _, params, _ in items):
        raise BadRequest(f"max_new_tokens must be at most {limit} (--max-new-tokens-limit, else the context length)")
    samples = sum(params.n for _, params, _ in items)
    if samples > config.max_queued_requests:
        raise BadRequest(
            f"the request asks for {samples} samples; the engine queues at most "
            f"{config.max_queued_requests} (--max-queued-requests)"
        )
    if not sched.alive():
        raise Unavailable(f"the engine failed and is restarting: {sched.failure or 'its engine thread stopped'}")
    if sched.released:  # no step can run (memory_occupation.py): refused rather than held until a resume
        raise Unavailable(
            f"the engine's memory is released ({', '.join(sorted(sched.released))}); /resume_memory_occupation first"
        )
    if sched.queued() + samples > config.max_queued_requests:
        raise Unavailable(
            f"the queue is full ({config.max_queued_requests} samples waiting, --max-queued-requests); retry later"
        )


def check_prompt_ids(engine, prompts: list[list[int]]) -> None:
    """Refuse empty prompts, ids outside the vocabulary and prompts that leave no room in the context."""
    vocab = engine.model.config.vocab_size
    if not prompts or not all(prompts):
        raise BadRequest("empty input")
    for p in prompts:
        if min(p) < 0 or max(p) >= vocab:  # C loops: this runs on the event loop, which shares the GIL
            raise BadRequest(f"input_ids must be in [0, {vocab})")
        if len(p) >= engine.pool.slot_len:
            raise BadRequest(f"the input is {len(p)} tokens; the context length is {engine.pool.slot_len}")


def prompts_of(engine, req: GenerateRequest) -> list[tuple[list[int], SamplingParams, str]]:
    """-> (prompt ids, SamplingParams, rid) per input (n is expanded by samples_of)."""
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("give exactly one of text or input_ids")
    single = req.is_single()
    if req.text is not None:
        prompts = [engine.tokenizer(t).input_ids for t in ([req.text] if single else req.text)]
    else:  # pydantic validated input_ids as one of its two list types; is_single tells which
        prompts = [cast(list[int], req.input_ids)] if single else cast(list[list[int]], req.input_ids)
    check_prompt_ids(engine, prompts)
    raw = req.sampling_params or SamplingParams()
    params = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(params) != len(prompts):
        raise BadRequest("one sampling_params per input, or a single one")
    rids = [req.rid] if isinstance(req.rid, str) else (req.rid or [new_rid() for _ in prompts])
    if len(rids) != len(prompts):
        raise BadRequest("one rid per input")
    return list(zip(prompts, params, rids))


def logprob_settings(engine, req: GenerateRequest, inputs: int) -> list[tuple[bool, int, int]]:
    """(return_logprob, top_logprobs_num, logprob_start_len) per input: each of SGLang's three fields is one for
    all inputs or one each (the last two count only where log-probs are returned)."""

    def each(value, default, what: str) -> list:
        if isinstance(value, list):
            if len(value) != inputs:
                raise BadRequest(f"one {what} per input, or a single one")
            return value
        return [default if value is None else value] * inputs

    wants = each(req.return_logprob, False, "return_logprob")
    tops = each(req.top_logprobs_num, 0, "top_logprobs_num")
    starts = each(req.logprob_start_len, -1, "logprob_start_len")
    if any(top > engine.model.config.vocab_size for top in tops):
        raise BadRequest("top_logprobs_num must be in [0, vocab]")
    return [(w, top if w else 0, start if w else -1) for w, top, start in zip(wants, tops, starts)]


def _waker(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, stream: bool) -> Callable[[Generation], None]:
    """A sample's on_update: wakes its queue's reader on the event loop. Waking the loop costs the engine thread
    the GIL: per token only when streaming, else once, when the sample finishes."""

    def wake(seq: Generation) -> None:
        if stream or seq.finished:
            loop.call_soon_threadsafe(q.put_nowait, 0)

    return wake


def samples_of(
    engine, items, stream: bool, logprobs: list[tuple[bool, int, int]]
) -> tuple[list[Generation], list[asyncio.Queue]]:
    """One Generation per sample (n children `rid-i` each, as SGLang names them, so an abort by rid
    reaches all) and the queue its updates arrive on; `logprobs`: each input's logprob_settings."""
    loop = asyncio.get_running_loop()
    seqs, queues = [], []
    for (prompt, params, rid), (wants, top_n, start_len) in zip(items, logprobs):
        for index in range(params.n):
            q: asyncio.Queue = asyncio.Queue()
            seed = None if params.sampling_seed is None else params.sampling_seed + index
            seqs.append(
                Generation(
                    rid=rid if params.n == 1 else f"{rid}-{index}",
                    prompt=list(prompt),
                    params=params,
                    generator=torch.Generator(engine.config.device).manual_seed(seed) if seed is not None else None,
                    on_update=_waker(loop, q, stream),
                    wants_logprobs=wants,
                    top_logprobs_num=top_n,
                    logprob_start_len=min(start_len, len(prompt) - 1),
                )
            )
            queues.append(q)
    return seqs, queues


def meta_info(seq: Generation, weight_version: str) -> dict:
    m: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output),
        "cached_tokens": seq.cached_tokens,
        "weight_version": weight_version,
    }
    if len(seq.spans) > 1:
        m["weight_versions"] = seq.spans
    if seq.wants_logprobs:
        m["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output)]
        if seq.top_logprobs_num:
            m["output_top_logprobs"] = [[[lp, tok, None] for lp, tok in step] for step in seq.top_logprobs]
        if seq.input_logprobs is not None:
            start = seq.logprob_start_len
            m["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.input_logprobs, seq.prompt[start:])]
    return m


def _events(engine, seqs: list[Generation], queues: list[asyncio.Queue], result):
    """Server-sent events: each carries the sample's output ids so far, as SGLang's do by default (with
    --incremental-streaming-output, SGLang's flag, only the ids new since the sample's last event)."""
    incremental = engine.config.incremental_streaming_output

    async def events():
        sent = [0] * len(seqs)
        try:
            pending = set(range(len(seqs)))
            while pending:
                for i in list(pending):
                    await queues[i].get()
                    # read `finished` before the chunk: if it finishes after, another update
                    # follows, so the last event always carries the finish reason
                    done = seqs[i].finished
                    chunk = result(seqs[i])
                    if incremental:
                        upto = len(chunk["output_ids"])
                        chunk["output_ids"] = chunk["output_ids"][sent[i] :]
                        sent[i] = upto
                    chunk["index"] = i
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if done:
                        pending.discard(i)
            yield "data: [DONE]\n\n"
        finally:  # client went away: abort what is left
            abort_unfinished(engine, seqs)

    return StreamingResponse(events(), media_type="text/event-stream")


async def wait_all(request: Request, seqs: list[Generation], queues: list[asyncio.Queue]) -> bool:
    """Until every sample finished (True) or the client disconnected (False)."""
    for seq, q in zip(seqs, queues):
        while not seq.finished:
            try:
                await asyncio.wait_for(q.get(), DISCONNECT_CHECK_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return False
    return True


def abort_unfinished(engine, seqs: list[Generation]) -> None:
    for seq in seqs:
        if not seq.finished:
            engine.scheduler.control(lambda rid=seq.rid: engine.scheduler.abort(rid))


async def answer_generate(engine, req: GenerateRequest, request: Request) -> Response:
    """Generate for one input or a batch; `sampling_params.n` samples per input share its prefill."""
    sched = engine.scheduler
    items = prompts_of(engine, req)
    check_capacity(engine, items)
    seqs, queues = samples_of(engine, items, req.stream, logprob_settings(engine, req, len(items)))
    for group in share_prompts(seqs):  # one prefill per distinct prompt
        sched.submit(group)

    def result(seq: Generation) -> dict:
        ids = list(seq.output)
        text = seq.text if seq.finished else engine.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "output_ids": ids, "meta_info": meta_info(seq, sched.weight_version)}

    if req.stream:
        return _events(engine, seqs, queues, result)
    try:
        if not await wait_all(request, seqs, queues):
            abort_unfinished(engine, seqs)  # the client went away: its samples stop taking KV slots
            return Response(status_code=499)
    except asyncio.CancelledError:
        abort_unfinished(engine, seqs)
        raise
    for seq in seqs:
        if seq.finish_reason is None:  # wait_all returned True: every sample finished
            raise RuntimeError(f"sample {seq.rid} is answered before it finished")
        REQUESTS.labels(seq.finish_reason["type"]).inc()
        TOKENS_OUT.inc(len(seq.output))
    results = [result(s) for s in seqs]
    # plain dicts through orjson: no jsonable_encoder pass over every token, and the encoding (on the
    # event loop, which shares the GIL with the engine thread) ~10x cheaper than json.dumps
    return Response(
        orjson.dumps(results[0] if req.is_single() and items[0][1].n == 1 else results), media_type="application/json"
    )


def validation_message(errors: Sequence[Mapping[str, Any]], skip: int = 0) -> str:
    """A body's validation errors as one line naming the fields (the first five); `skip` leading parts of each
    error's location (FastAPI's "body")."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'][skip:]) or 'body'}: {e['msg']}" for e in errors[:5])


def generate_router(engine) -> APIRouter:
    router = APIRouter(tags=["generation"])
    sched = engine.scheduler

    @router.post(
        "/generate",
        response_model=GenerateResult | list[GenerateResult],
        responses={
            400: {"description": "a body the engine cannot serve"},
            503: {"description": "the queue is full, the engine failed, or its memory is released"},
        },
    )
    async def generate(req: GenerateRequest, request: Request):
        """Generate for one input or a batch; `sampling_params.n` samples per input share its prefill."""
        return await answer_generate(engine, req, request)

    @router.post("/abort_request")
    async def abort_request(req: AbortRequest | None = None):
        """Abort the requests whose rid starts with `rid`, or every request (`abort_all`)."""
        if req is not None and (req.abort_all or req.rid is not None):
            await engine.run_control(lambda: sched.abort(None if req.abort_all else req.rid))
        return Response(status_code=200)

    return router
