"""SGLang's control routes on the built-in engine: pause / continue / flush, weight updates, memory release and
resume, version and model info, and the service routes (health, metrics, spans)."""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.precision import WeightMismatch
from services.engine.protocol import (
    ControlResult,
    DestroyGroupRequest,
    InitGroupRequest,
    ModelInfo,
    PauseRequest,
    UpdateWeightVersionRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsRequest,
    WeightVersion,
)
from services.engine.generate_routes import error_response
from services.engine.memory_occupation import (
    WEIGHTS,
    WEIGHTS_RELEASED,
    MemoryOccupation,
    MemoryOccupationError,
    MemoryOccupationRequest,
    ServerInfoWithMemory,
    WeightsReleased,
    load_unless_released,
    memory_state,
)
from services.engine.request import Generation, new_rid
from services.engine.sampling import SamplingParams
from services.runtime.metrics import observability_router

HEALTH_GENERATE_S = 20.0  # SGLang's probe timeout

try:
    SLUICE_VERSION = version("sluice-rl")
except PackageNotFoundError:  # run from a checkout that is not installed (a GPU machine's PYTHONPATH)
    SLUICE_VERSION = "dev"


def result(message: str, ok: bool = True, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else status)


def update_failed(exc: Exception) -> JSONResponse:
    """A failed weight update: 422 when the weights do not fit the model (a resend cannot fix that; the trainer
    fails the run with this message), 400 for a transfer that failed (a resend may succeed). Either way nothing
    was loaded."""
    status = 422 if isinstance(exc, WeightMismatch) else 400
    return result(f"update failed; the previous weights keep serving: {exc}", ok=False, status=status)


def generation_control_router(engine) -> APIRouter:
    router = APIRouter(tags=["generation control"])
    sched = engine.scheduler

    @router.post("/pause_generation")
    async def pause(req: PauseRequest | None = None):
        """abort: running requests end with finish_reason abort; in_place: they freeze, KV kept;
        retract: they go back to the queue and are recomputed on continue."""
        mode = (req or PauseRequest()).mode
        await engine.run_control(lambda: sched.pause(mode))
        return {"message": f"paused ({mode})", "status": "ok"}

    @router.post("/continue_generation")
    async def cont():
        def resume():
            if WEIGHTS not in sched.released:  # released weights take nothing staged (memory_occupation.py)
                engine.weights.load()  # weights staged while paused go live before anything runs again
            sched.resume()

        await engine.run_control(resume)
        return {"message": "continued", "status": "ok"}

    @router.api_route("/flush_cache", methods=["GET", "POST"], response_model=ControlResult)
    async def flush_cache():
        """Empty the engine's caches (the n-gram index speculative decoding drafts from); refused while
        requests are running or waiting."""
        if sched.busy():
            return result("cannot flush the cache while requests are running or waiting", ok=False)
        await engine.run_control(sched.speculation.ngrams.clear)
        return result("cache flushed")

    return router


def weight_update_routers(engine) -> list[APIRouter]:
    """Every weight-update route (the server refuses them all without a token): the group's, the updates', and
    memory release / resume (resumed weights are zeros until an update: as much a weight change as an update)."""
    return [_group_routes(engine), _update_routes(engine), memory_router(engine)]


def _group_routes(engine) -> APIRouter:
    router = APIRouter(tags=["weight updates"])

    @router.post("/init_weights_update_group", response_model=ControlResult)
    async def init_group(req: InitGroupRequest):
        """Join the trainer's broadcast group; answers once every member joined."""
        try:
            group = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: BroadcastGroup.open(
                    req.group_name,
                    req.backend,
                    req.master_address,
                    req.master_port,
                    req.rank_offset,
                    req.world_size,
                    engine.config.weight_sync_timeout_s,
                ),
            )
        except Exception as exc:
            return result(f"failed to join the weight update group: {exc}", ok=False)
        engine.weights.groups[group.name] = group
        return result(f"joined {group.name} as rank {group.rank}")

    @router.post("/destroy_weights_update_group", response_model=ControlResult)
    async def destroy_group(req: DestroyGroupRequest):
        group = engine.weights.groups.pop(req.group_name, None)
        if group is None:
            return result("no such group", ok=False)
        group.close()
        return result("destroyed")

    return router


async def take_update(engine, receive, req, sender_waits: bool = False) -> JSONResponse:
    """Every weight update's course: refuse a cache flush while in_place-paused requests hold KV, and an update
    while the weights are released (a sender waiting in a broadcast is received first, then refused); end
    every request first when `abort_all_requests` (SGLang's) asks; receive off the engine thread (decoding
    goes on during the transfer); load between two steps unless begin/end or a pause holds the version back
    (weight_updates.py)."""
    sched = engine.scheduler
    if WEIGHTS in sched.released and not sender_waits:
        return result(WEIGHTS_RELEASED, ok=False)
    if req.flush_cache and sched.frozen:
        return result(
            "flush_cache is not allowed while in_place-paused requests hold KV; send flush_cache: false", ok=False
        )
    if req.abort_all_requests:
        await engine.run_control(lambda: sched.abort(None))
    try:
        await asyncio.get_running_loop().run_in_executor(None, receive, req)
        message = await engine.run_control(lambda: load_unless_released(engine, engine.weights.load_unless_held))
    except WeightsReleased as exc:
        return result(str(exc), ok=False)
    except Exception as exc:
        return update_failed(exc)
    return result(message)


def _update_routes(engine) -> APIRouter:
    router = APIRouter(tags=["weight updates"])
    sched = engine.scheduler

    @router.post("/begin_weight_update", response_model=ControlResult)
    async def begin_update():
        return result(engine.weights.begin())

    @router.post("/end_weight_update", response_model=ControlResult)
    async def end_update():
        try:
            return result(await engine.run_control(lambda: load_unless_released(engine, engine.weights.end)))
        except WeightsReleased as exc:
            return result(str(exc), ok=False)
        except Exception as exc:
            return update_failed(exc)

    @router.post("/update_weights_from_distributed", response_model=ControlResult)
    async def update(req: UpdateWeightsRequest):
        """Receive the named tensors from the group's rank 0: one broadcast each, or the bucket in one
        (`flat_bucket`, Sluice's; `load_format: "flattened_bucket"`, SGLang's)."""
        return await take_update(engine, engine.weights.receive, req, sender_waits=True)

    @router.post("/update_weights_from_disk", response_model=ControlResult)
    async def update_from_disk(req: UpdateWeightsFromDiskRequest):
        """SGLang's (AReaL's disk mode): the weights of a model directory on this machine (safetensors only)."""
        return await take_update(engine, engine.weights.read_files, req)

    @router.post("/update_weights_from_tensor", response_model=ControlResult)
    async def update_from_tensor(req: UpdateWeightsFromTensorRequest):
        """A bucket on this engine's GPU, shared by the trainer through a CUDA IPC handle (load_format
        sluice_cuda_ipc; SGLang's pickled form is refused), copied out before the call answers."""
        return await take_update(engine, engine.weights.receive_shared, req)

    @router.post("/update_weight_version", response_model=ControlResult)
    async def update_weight_version(req: UpdateWeightVersionRequest):
        """SGLang's: report `new_version` from now on (a trainer sets it where an update left it unrecorded);
        with `abort_all_requests` every request ends first, with its partial output."""

        def set_version():
            if req.abort_all_requests:
                sched.abort(None)
            sched.weight_version = req.new_version
            engine.weights.on_version()

        await engine.run_control(set_version)
        return result(f"weight version {req.new_version}")

    return router


def memory_router(engine) -> APIRouter:
    """SGLang's /release_memory_occupation and /resume_memory_occupation (memory_occupation.py): GET or POST,
    `{"tags": [...]}` (null or [] for kv_cache, weights and cuda_graph), answered `null` once done, as SGLang
    answers; a refusal is 400 `{"error": {"message"}}` and changes nothing."""
    router = APIRouter(tags=["memory occupation"])
    memory = MemoryOccupation(engine)

    async def run(action, req: MemoryOccupationRequest | None):
        try:
            await engine.run_control(lambda: action((req or MemoryOccupationRequest()).chosen()))
        except MemoryOccupationError as exc:
            return error_response(str(exc))
        return None

    @router.api_route(
        "/release_memory_occupation",
        methods=["GET", "POST"],
        response_model=None,
        responses={400: {"description": "requests are running, or a tag is already released"}},
    )
    async def release(req: MemoryOccupationRequest | None = None):
        """Free the tagged memory; needs an idle engine (requests may wait in a paused one). Until resumed,
        /generate answers 503 and weight updates 400 while the weights are released."""
        return await run(memory.release, req)

    @router.api_route(
        "/resume_memory_occupation",
        methods=["GET", "POST"],
        response_model=None,
        responses={400: {"description": "a tag is not released, or its memory cannot be had"}},
    )
    async def resume(req: MemoryOccupationRequest | None = None):
        """Allocate the tagged memory again: an empty KV pool, zero-filled weights (send weights next)."""
        return await run(memory.resume, req)

    return router


def engine_info_router(engine) -> APIRouter:
    router = APIRouter(tags=["engine info"])
    sched = engine.scheduler

    @router.get("/get_weight_version", response_model=WeightVersion)
    @router.get("/weight_version", response_model=WeightVersion)
    async def weight_version(newer_than: str | None = None, wait_s: float = Query(0.0, ge=0.0, le=60.0)):
        """With `newer_than` (a Sluice extension; SGLang ignores it and answers at once): a long poll that
        answers when the version differs from it, or after wait_s seconds."""
        if newer_than is not None and wait_s > 0:
            return {"weight_version": await engine.version_moved.wait(lambda: sched.weight_version, newer_than, wait_s)}
        return {"weight_version": sched.weight_version}

    @router.get("/get_model_info", response_model=ModelInfo)
    @router.get("/model_info", response_model=ModelInfo)
    async def model_info():
        return {
            "model_path": engine.config.model,
            "tokenizer_path": engine.config.model,
            "is_generation": True,
            "weight_version": sched.weight_version,
            # Sluice extensions (weight_updates.py): updates load between steps, so no pause is needed;
            # a bucket can come as one broadcast
            "live_weight_update": True,
            "flat_bucket_update": True,
            "weights_dtype": engine.config.dtype,
            "gpu": engine.gpu,
            "cuda_ipc_update": engine.gpu is not None,
            "lora_adapter_update": True,
        }

    @router.get("/get_server_info", response_model=ServerInfoWithMemory)
    @router.get("/server_info", response_model=ServerInfoWithMemory)
    async def server_info():
        c = engine.config
        return {
            "model_path": c.model,
            "dtype": c.dtype,
            "device": c.device,
            "tp_size": 1,
            "mem_fraction_static": c.mem_fraction_static,
            "max_running_requests": c.max_running,
            "context_length": sched.pool.slot_len,
            "chunked_prefill_size": c.chunked_prefill_size,
            "speculative_algorithm": None if c.speculative_algorithm == "none" else c.speculative_algorithm,
            "weight_version": sched.weight_version,
            "version": f"sluice-{SLUICE_VERSION}",
            "memory_occupation": memory_state(engine),
        }

    return router


def service_router(engine) -> APIRouter:
    """/health (503 once the engine failed), and /metrics and /spans (spans: generate = busy forward steps,
    pause, weight_load)."""
    router = APIRouter(tags=["service"])

    @router.get("/health_generate", responses={503: {"description": "no token came within 20 s, or the engine failed"}})
    async def health_generate():
        """SGLang's deep probe: one token generated through the scheduler (held while paused, as SGLang's is;
        503 at once while memory is released)."""
        if engine.scheduler.released:
            return Response(status_code=503)
        loop, done = asyncio.get_running_loop(), asyncio.Event()

        def wake(r: Generation) -> None:
            if r.finished:
                loop.call_soon_threadsafe(done.set)

        probe = Generation(
            rid=f"health-{new_rid()}", prompt=[0], params=SamplingParams(max_new_tokens=1), on_update=wake
        )
        engine.scheduler.submit([probe])
        try:
            await asyncio.wait_for(done.wait(), HEALTH_GENERATE_S)
        except TimeoutError:
            await engine.run_control(lambda: engine.scheduler.abort(probe.rid))
        reason = probe.finish_reason  # None: no token within HEALTH_GENERATE_S
        ok = reason is not None and reason["type"] != "abort" and engine.scheduler.alive()
        return Response(status_code=200 if ok else 503)

    @router.get("/health", responses={503: {"description": "the engine failed (it exits and is restarted)"}})
    async def health():
        if not engine.scheduler.alive():
            return JSONResponse({"error": {"message": f"engine failed: {engine.scheduler.failure}"}}, status_code=503)
        return Response(status_code=200)

    router.include_router(observability_router())
    return router
