"""The built-in engine's HTTP server: SGLang's protocol (the subset in docs/engine.md) over the
continuous-batching Scheduler. The routes live in generate_routes.py and control_routes.py, the bodies in
protocol.py; this module holds the engine's state and puts the app together."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import torch
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import Gauge
from starlette.routing import Route

from services.dcs.sync.backend_choice import gpu_uuid
from services.engine.config import EngineConfig
from services.engine.control_routes import (
    engine_info_router,
    generation_control_router,
    service_router,
    weight_update_routers,
)
from services.engine.generate_lane import GenerateLane
from services.engine.generate_routes import (
    BadRequest,
    Unavailable,
    error_response,
    generate_router,
    refusal,
    validation_message,
)
from services.engine.openai_routes import openai_router
from services.engine.parallel_forward import ParallelForward
from services.engine.run_registration import stay_registered
from services.engine.scheduler import Scheduler, StepForward
from services.engine.weight_updates import WeightUpdates
from services.engine.batched_decoder import BatchedDecoder
from services.engine.kv_pool import KVPool
from services.model.loading import load_causal_lm
from services.runtime.heap import freeze_heap
from services.runtime.http_auth import PathRefusal, require_bearer_token
from services.runtime.http_service import serve_http
from services.runtime.service_main import ServiceFailed

log = logging.getLogger(__name__)
RUNNING = Gauge("sluice_engine_running_requests", "sequences decoding (running or frozen by an in_place pause)")
WAITING = Gauge("sluice_engine_waiting_requests", "sequences queued for admission")
STEPS = Gauge("sluice_engine_steps", "forward steps run since start")
KV_USED = Gauge("sluice_engine_kv_slots_used", "KV pool slots held by requests")
DRAFTED = Gauge("sluice_engine_draft_tokens", "speculative draft tokens verified since start")
ACCEPTED = Gauge("sluice_engine_accepted_draft_tokens", "speculative draft tokens accepted since start")
# liveness only: a probe carries no secret, and /health says nothing an attacker could use
OPEN_PATHS = frozenset({"/health"})


class Engine:
    """Model, scheduler and weight-update state of one server."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model, self.tokenizer = load_causal_lm(config.model, config.dtype, config.device)
        self.gpu = gpu_uuid(config.device)  # a trainer on the same GPU sends weights by CUDA IPC handle
        self.pool = make_pool(self.model, config)
        self.scheduler = make_scheduler(BatchedDecoder(self.model, self.pool), self.tokenizer, config)
        self.version_moved = VersionWatch()
        self.weights = WeightUpdates(
            self.model,
            self.scheduler,
            config.device,
            self.version_moved.fire_threadsafe,
            bracket_timeout_s=config.weight_sync_timeout_s,
        )
        RUNNING.set_function(lambda: len(self.scheduler.running) + len(self.scheduler.frozen))
        WAITING.set_function(lambda: len(self.scheduler.waiting))
        STEPS.set_function(lambda: self.scheduler.steps)
        KV_USED.set_function(lambda: self.pool.slots - self.pool.free_slots)
        DRAFTED.set_function(lambda: self.scheduler.speculation.drafted)
        ACCEPTED.set_function(lambda: self.scheduler.speculation.accepted)

    async def run_control(self, fn):
        """Run fn on the engine thread between two steps; its result (or its exception, raised here)."""
        done = self.scheduler.control(fn)
        await asyncio.get_running_loop().run_in_executor(None, done.wait)
        if done.error is not None:
            raise done.error
        return done.result


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


def make_scheduler(decoder: BatchedDecoder, tokenizer, config: EngineConfig) -> Scheduler:
    drafts = config.speculative_num_draft_tokens if config.speculative_algorithm == "ngram" else 0
    forward: StepForward = decoder
    if config.forward_workers > 1:
        forward = ParallelForward(decoder, config.forward_workers)
    return Scheduler(
        forward, tokenizer, config.chunked_prefill_size, num_draft_tokens=drafts, draft_budget=config.max_running
    )


def tokens_that_fit(device_bytes: int, allocated_bytes: int, fraction: float, token_bytes: int) -> int:
    """KV tokens in what `fraction` of the device leaves after what is already allocated (the weights), as
    SGLang's --mem-fraction-static budgets weights and KV pool together."""
    return max(0, int(device_bytes * fraction) - allocated_bytes) // token_bytes


def make_pool(model, config: EngineConfig) -> KVPool:
    """Slots of `context_length` positions each: as many as `max_total_tokens` holds, at most max_running."""
    cfg = model.config
    context = config.context_length or min(cfg.max_position_embeddings, 4096)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    total = config.max_total_tokens or config.max_running * context
    if torch.device(config.device).type == "cuda":
        device = torch.device(config.device)
        element = next(model.parameters()).element_size()
        token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element
        total = min(
            total,
            tokens_that_fit(
                torch.cuda.get_device_properties(device).total_memory,
                torch.cuda.memory_allocated(device),
                config.mem_fraction_static,
                token_bytes,
            ),
        )
    slots = min(config.max_running, total // context)
    if slots < 1:
        raise ValueError(
            f"the KV pool's {total} tokens hold no request of context length {context} "
            "(raise --max-total-tokens or --mem-fraction-static, or lower --context-length)"
        )
    pool = KVPool(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        head_dim,
        slots,
        context,
        dtype=next(model.parameters()).dtype,
        device=config.device,
    )
    log.info("kv pool", extra={"slots": slots, "context_length": context, "mib": pool.nbytes() >> 20})
    return pool


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="Sluice engine (SGLang protocol)")

    # SGLang answers a body it cannot use with 400 and a message (FastAPI's default would be 422)
    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        return error_response(validation_message(exc.errors(), skip=1))

    async def refused(_: Request, exc: Exception) -> Response:  # async: a sync one would run in Starlette's threadpool
        if not isinstance(exc, (BadRequest, Unavailable)):  # registered below for these two kinds only
            raise exc
        return refusal(exc)

    for kind in (BadRequest, Unavailable):
        app.add_exception_handler(kind, refused)

    weights = weight_update_routers(engine)
    for router in (
        generate_router(engine),
        openai_router(engine),
        generation_control_router(engine),
        *weights,
        engine_info_router(engine),
        service_router(engine),
    ):
        app.include_router(router)
    if not engine.config.auth_token and not engine.config.allow_unauthenticated_weight_updates:
        refuse_paths(
            app,
            route_paths(weights),
            "the engine has no auth token configured "
            "(SLUICE_AUTH_TOKEN or --auth-token-file), so weight updates are refused; "
            "--allow-unauthenticated-weight-updates accepts them anyway",
        )
    require_bearer_token(app, engine.config.auth_token, OPEN_PATHS)
    return app


def route_paths(routers: list[APIRouter]) -> set[str]:
    """The path of every route of `routers`; TypeError for a route without one (it could not be refused)."""
    paths = set()
    for route in (r for router in routers for r in router.routes):
        if not isinstance(route, Route):
            raise TypeError(f"{route!r} is no route with a path")
        paths.add(route.path)
    return paths


def refuse_paths(app: FastAPI, paths: set[str], why: str) -> None:
    """403 with `why` on `paths`, before their routes run."""
    app.add_middleware(PathRefusal, paths=paths, response=error_response(why, 403))


async def serve(config: EngineConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(config.torch_threads)
    if not config.auth_token:
        log.warning(
            "no auth token (SLUICE_AUTH_TOKEN or --auth-token-file): every route but weight updates is "
            "open to anyone who reaches the port"
        )
        if config.allow_unauthenticated_weight_updates:
            log.warning(
                "UNAUTHENTICATED WEIGHT UPDATES ALLOWED: anyone who reaches this port can replace the "
                "model's weights (--allow-unauthenticated-weight-updates)"
            )
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(None, Engine, config)
    engine.version_moved.loop = loop
    closer = asyncio.create_task(engine.version_moved.close_when(stop))

    # a failed step stops the server (its requests were failed): exit 1, and the supervisor restarts the engine
    def stop_serving(_: BaseException) -> None:
        loop.call_soon_threadsafe(stop.set)

    engine.scheduler.on_fatal = stop_serving
    freeze_heap()  # the model and the KV pool's bookkeeping live as long as the process (services/runtime/heap.py)
    engine.scheduler.start()
    log.info("engine serving", extra={"port": config.port, "model": config.model})
    registered = (
        asyncio.create_task(stay_registered(config, engine.gpu, lambda: engine.scheduler.weight_version, stop))
        if config.dcs_url
        else None
    )
    try:
        app = GenerateLane(build_app(engine), engine, config.auth_token)  # POST /generate bypasses the app
        await serve_http(app, config.host, config.port, stop, tls=config)
    finally:
        closer.cancel()
        if registered is not None:  # unregistered now, not when the lease lapses: the rollout moves on at once
            registered.cancel()
            await asyncio.gather(registered, return_exceptions=True)
        engine.scheduler.stop()
        log.info("engine stopped")
    if engine.scheduler.failure is not None:
        raise ServiceFailed(f"an engine step failed: {engine.scheduler.failure}")
