"""The built-in engine's HTTP server: SGLang's protocol (the subset in docs/engine.md) over the
continuous-batching Scheduler."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import torch
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest
from pydantic import ValidationError

from services.dcs.sync.groups import BroadcastGroup
from services.model.batched_decoder import BatchedDecoder
from services.model.kv_pool import KVPool
from services.model.loading import load_causal_lm
from services.rollout.engine.config import EngineConfig
from services.rollout.engine.request import Generation, new_rid, share_prompts
from services.rollout.engine.sampling import SamplingParams
from services.rollout.engine.scheduler import Scheduler
from services.rollout.engine.weight_updates import WeightUpdates
from services.runtime.http_service import serve_http
from services.runtime.spans import RECORDER

log = logging.getLogger(__name__)
TOKENS_OUT = Counter("sluice_engine_generated_tokens_total", "tokens generated")
RUNNING = Gauge("sluice_engine_running_requests", "sequences decoding (running or frozen by an in_place pause)")
WAITING = Gauge("sluice_engine_waiting_requests", "sequences queued for admission")
STEPS = Gauge("sluice_engine_steps", "forward steps run since start")
KV_USED = Gauge("sluice_engine_kv_slots_used", "KV pool slots held by requests")
REQUESTS = Counter("sluice_engine_requests_total", "generate requests", ["finish"])


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _control_result(message: str, ok: bool = True) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)


class Engine:
    """Model, scheduler and weight-update state of one server."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model, self.tokenizer = load_causal_lm(config.model, config.dtype, config.device)
        self.pool = make_pool(self.model, config)
        self.scheduler = Scheduler(BatchedDecoder(self.model, self.pool), self.tokenizer, config.chunked_prefill_size)
        self.version_moved = VersionWatch()
        self.weights = WeightUpdates(self.model, self.scheduler, config.device, self.version_moved.fire_threadsafe,
                                     bracket_timeout_s=config.weight_sync_timeout_s)
        RUNNING.set_function(lambda: len(self.scheduler.running) + len(self.scheduler.frozen))
        WAITING.set_function(lambda: len(self.scheduler.waiting))
        STEPS.set_function(lambda: self.scheduler.steps)
        KV_USED.set_function(lambda: self.pool.slots - self.pool.free_slots)


class VersionWatch:
    """Wakes long polls of /weight_version when the engine's weight version changes (fired from the
    engine thread)."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()
        self.closed = False  # shutting down: waiters answer now rather than hold the server open

    def fire_threadsafe(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def close_when(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.closed = True
        self._fire()

    async def wait(self, current: Callable[[], str], newer_than: str, wait_s: float) -> str:
        """The version once it differs from `newer_than`, or after wait_s, whichever comes first."""
        deadline = time.monotonic() + wait_s
        while current() == newer_than and not self.closed and (left := deadline - time.monotonic()) > 0:
            try:  # _fire runs on this loop too: nothing moves between the check above and this wait
                await asyncio.wait_for(self._event.wait(), left)
            except TimeoutError:
                break
        return current()


def make_pool(model, config: EngineConfig) -> KVPool:
    """Slots of `context_length` positions each: as many as `max_total_tokens` holds, at most max_running."""
    cfg = model.config
    context = config.context_length or min(cfg.max_position_embeddings, 4096)
    total = config.max_total_tokens or config.max_running * context
    slots = min(config.max_running, total // context)
    if slots < 1:
        raise ValueError(f"max_total_tokens {total} holds no request of context length {context}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, slots, context,
                  dtype=next(model.parameters()).dtype, device=config.device)
    log.info("kv pool", extra={"slots": slots, "context_length": context, "mib": pool.nbytes() >> 20})
    return pool


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="Sluice engine (SGLang protocol)")
    sched = engine.scheduler

    async def run_control(fn):
        done = sched.control(fn)
        await asyncio.get_running_loop().run_in_executor(None, done.wait)
        if done.error is not None:
            raise done.error
        return done.result

    # ------------------------------------------------------------ generate

    def parse(body: dict):
        """-> list of (prompt ids, SamplingParams, rid), one per input (n is expanded by group_of)."""
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise ValueError("give exactly one of text or input_ids")
        single = isinstance(body.get("text"), str) or (has_ids and body["input_ids"] and isinstance(body["input_ids"][0], int))
        if has_text:
            texts = [body["text"]] if single else body["text"]
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError("text must be a string or a list of strings")
            prompts = [engine.tokenizer(t).input_ids for t in texts]
        else:
            prompts = [body["input_ids"]] if single else body["input_ids"]
            if not isinstance(prompts, list) or not all(isinstance(p, list) and all(isinstance(i, int) for i in p)
                                                        for p in prompts):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        vocab = engine.model.config.vocab_size
        if not prompts:
            raise ValueError("empty input")
        for p in prompts:
            if not p:
                raise ValueError("empty input")
            if any(i < 0 or i >= vocab for i in p):
                raise ValueError(f"input_ids must be in [0, {vocab})")
            if len(p) >= engine.pool.slot_len:
                raise ValueError(f"the input is {len(p)} tokens; the context length is {engine.pool.slot_len}")
        raw = body.get("sampling_params") or {}
        raws = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(raws) != len(prompts):
            raise ValueError("one sampling_params per input, or a single one")
        params = [SamplingParams.model_validate(r) for r in raws]
        rids = body.get("rid")
        rids = [rids] if isinstance(rids, str) else (rids or [new_rid() for _ in prompts])
        if len(rids) != len(prompts):
            raise ValueError("one rid per input")
        return list(zip(prompts, params, rids)), single and params[0].n == 1

    def meta(seq: Generation, with_logprobs: bool) -> dict:
        m = {"id": seq.rid, "finish_reason": seq.finish_reason, "prompt_tokens": len(seq.prompt),
             "completion_tokens": len(seq.output), "cached_tokens": seq.cached_tokens, "weight_version": sched.weight_version}
        if len(seq.spans) > 1:
            m["weight_versions"] = seq.spans
        if with_logprobs:
            m["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output)]
            if seq.top_logprobs_num:
                m["output_top_logprobs"] = [[[lp, tok, None] for lp, tok in step] for step in seq.top_logprobs]
            if seq.input_logprobs is not None:
                start = seq.logprob_start_len
                m["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.input_logprobs, seq.prompt[start:])]
        return m

    def children(items, stream: bool, top_n: int, start_len: int) -> tuple[list[Generation], list[asyncio.Queue]]:
        """One Generation per sample (n children `rid-i` each, as SGLang names them, so an abort by rid
        reaches all) and the queue its updates arrive on."""
        loop = asyncio.get_running_loop()
        seqs, queues = [], []
        for prompt, params, rid in items:
            for index in range(params.n):
                q: asyncio.Queue = asyncio.Queue()
                seed = None if params.sampling_seed is None else params.sampling_seed + index
                seqs.append(Generation(
                    rid=rid if params.n == 1 else f"{rid}-{index}", prompt=list(prompt), params=params,
                    generator=torch.Generator(engine.config.device).manual_seed(seed) if seed is not None else None,
                    # waking the event loop costs the engine thread the GIL: per token only when streaming
                    on_update=lambda r, q=q: (stream or r.finished) and loop.call_soon_threadsafe(q.put_nowait, 0),
                    top_logprobs_num=top_n, logprob_start_len=min(start_len, len(prompt) - 1)))
                queues.append(q)
        return seqs, queues

    @app.post("/generate")
    async def generate(request: Request):
        try:
            body = await request.json()
            items, single = parse(body)
        except (ValueError, ValidationError, json.JSONDecodeError) as exc:
            return _error(str(exc))
        with_logprobs = bool(body.get("return_logprob"))
        try:
            top_n = int(body.get("top_logprobs_num") or 0)
            start_len = int(body.get("logprob_start_len", -1))
        except (TypeError, ValueError):
            return _error("top_logprobs_num and logprob_start_len must be integers")
        if top_n < 0 or top_n > engine.model.config.vocab_size or start_len < -1:
            return _error("top_logprobs_num must be in [0, vocab] and logprob_start_len >= -1")
        stream = bool(body.get("stream"))
        seqs, queues = children(items, stream, top_n if with_logprobs else 0, start_len if with_logprobs else -1)
        for group in share_prompts(seqs):  # one prefill per distinct prompt
            sched.submit(group)

        def result(seq: Generation) -> dict:
            ids = list(seq.output)
            text = seq.text if seq.finished else engine.tokenizer.decode(ids, skip_special_tokens=True)
            return {"text": text, "output_ids": ids, "meta_info": meta(seq, with_logprobs)}

        if stream:
            async def events():
                sent = [0] * len(seqs)
                try:
                    pending = set(range(len(seqs)))
                    while pending:
                        for i in list(pending):
                            await queues[i].get()
                            seq = seqs[i]
                            # read `finished` before the chunk: if it finishes after, another update
                            # follows, so the last event always carries the finish reason
                            done = seq.finished
                            chunk = result(seq)
                            upto = len(chunk["output_ids"])
                            chunk["output_ids"] = chunk["output_ids"][sent[i]:]
                            sent[i] = upto
                            chunk["index"] = i
                            yield f"data: {json.dumps(chunk)}\n\n"
                            if done:
                                pending.discard(i)
                    yield "data: [DONE]\n\n"
                finally:  # client went away: abort what is left
                    for seq in seqs:
                        if not seq.finished:
                            sched.control(lambda rid=seq.rid: sched.abort(rid))
            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            for seq, q in zip(seqs, queues):
                while not seq.finished:
                    await q.get()
        except asyncio.CancelledError:
            for seq in seqs:
                sched.control(lambda rid=seq.rid: sched.abort(rid))
            raise
        for seq in seqs:
            REQUESTS.labels(seq.finish_reason["type"]).inc()
            TOKENS_OUT.inc(len(seq.output))
        results = [result(s) for s in seqs]
        return JSONResponse(results[0] if single else results)  # plain dicts: no jsonable_encoder pass

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.json() if await request.body() else {}
        prefix = None if body.get("abort_all") else body.get("rid")
        if prefix is not None or body.get("abort_all"):
            await run_control(lambda: sched.abort(prefix))
        return Response(status_code=200)

    # ------------------------------------------------------------ pause / continue / cache

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await request.json() if await request.body() else {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return _error(f"unknown pause mode {mode!r}")
        await run_control(lambda: sched.pause(mode))
        return {"message": f"paused ({mode})", "status": "ok"}

    @app.post("/continue_generation")
    async def cont():
        def resume():
            engine.weights.load()  # weights staged while paused go live before anything runs again
            sched.resume()
        await run_control(resume)
        return {"message": "continued", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if sched.busy():
            return _control_result("cannot flush the cache while requests are running or waiting", ok=False)
        return _control_result("cache flushed")

    # ------------------------------------------------------------ weights

    @app.post("/init_weights_update_group")
    async def init_group(body: dict):
        try:
            group = await asyncio.get_running_loop().run_in_executor(None, lambda: BroadcastGroup.open(
                body.get("group_name", "weight_update_group"), body.get("backend", "gloo"), body["master_address"],
                int(body["master_port"]), int(body["rank_offset"]), int(body["world_size"]),
                engine.config.weight_sync_timeout_s))
        except Exception as exc:
            return _control_result(f"failed to join the weight update group: {exc}", ok=False)
        engine.weights.groups[group.name] = group
        return _control_result(f"joined {group.name} as rank {group.rank}")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(body: dict):
        group = engine.weights.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return _control_result("no such group", ok=False)
        group.close()
        return _control_result("destroyed")

    @app.post("/begin_weight_update")
    async def begin_update():
        return _control_result(engine.weights.begin())

    @app.post("/end_weight_update")
    async def end_update():
        return _control_result(await run_control(engine.weights.end))

    @app.post("/update_weights_from_distributed")
    async def update(body: dict):
        if body.get("flush_cache", True) and sched.frozen:
            return _control_result("flush_cache is not allowed while in_place-paused requests hold KV; "
                                   "send flush_cache: false", ok=False)
        try:  # received off the engine thread: decoding goes on during the transfer
            await asyncio.get_running_loop().run_in_executor(None, engine.weights.receive, body)
            message = await run_control(engine.weights.load_unless_held)
        except Exception as exc:
            return _control_result(f"update failed; the previous weights keep serving: {exc}", ok=False)
        return _control_result(message)

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def weight_version(newer_than: str | None = None, wait_s: float = Query(0.0, ge=0.0, le=60.0)):
        """With `newer_than` (a Sluice extension; SGLang ignores it and answers at once): a long poll that
        answers when the version differs from it, or after wait_s seconds."""
        if newer_than is not None and wait_s > 0:
            return {"weight_version": await engine.version_moved.wait(lambda: sched.weight_version, newer_than,
                                                                      wait_s)}
        return {"weight_version": sched.weight_version}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {"model_path": engine.config.model, "tokenizer_path": engine.config.model, "is_generation": True,
                "weight_version": sched.weight_version,
                # Sluice extensions (weight_updates.py): updates load between steps, so no pause is needed;
                # a bucket can come as one broadcast
                "live_weight_update": True, "flat_bucket_update": True}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/spans")
    async def spans(since: float = 0.0):
        """Recent spans (generate = busy forward steps, pause, weight_load) that ended after `since`."""
        return RECORDER.since(since)

    return app


async def serve(config: EngineConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(1)
    engine = await asyncio.get_running_loop().run_in_executor(None, Engine, config)
    engine.version_moved.loop = asyncio.get_running_loop()
    closer = asyncio.create_task(engine.version_moved.close_when(stop))
    engine.scheduler.start()
    log.info("engine serving", extra={"port": config.port, "model": config.model})
    try:
        await serve_http(build_app(engine), config.host, config.port, stop)
    finally:
        closer.cancel()
        engine.scheduler.stop()
        log.info("engine stopped")
