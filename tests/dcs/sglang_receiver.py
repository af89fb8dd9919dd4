"""A minimal receiver process that speaks the SGLang weight-update endpoints as SGLang's source does (read from
the sglang 0.5.5, 0.5.6 and 0.5.23 wheels), standing in for a real SGLang server (which cannot run here): it joins
the weight-update group with SGLang's own construction (custom_process_group below, not Sluice's code) and
receives with torch.distributed.broadcast on that group: each tensor on its own, or, with
`load_format: "flattened_bucket"` (0.5.6 and 0.5.23; 0.5.5 ignores the field), the call's tensors back to back in
one uint8 broadcast, as each release's FlattenedTensorBucket lays them out (receive_flattened below). It emulates
the release differences the client must cope with, and reports its release as `version` in its server info.
Given a model directory (`--model-path`), it also generates from it and serves LoRA adapters through SGLang
0.5.23's routes (tests/dcs/sglang_generation.py; the LoRA flags as SGLang's).

    python -m tests.dcs.sglang_receiver --port P --dcs URL --run-id R --release 0.5.6 [--fail-version V]
        [--model-path DIR [--enable-lora --max-lora-rank R --lora-target-modules M ...]]

It registers itself with DCS as an engine node and heartbeats. /stats (not SGLang) lets tests read
what happened: pause/continue calls, the weights' digest, the weight version, and per update call its
load_format and how many broadcasts it took."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.dcs.client import DCSClient
from services.dcs.models import Heartbeat, NodeRegistration
from tests.dcs.sglang_generation import LoraArgs, add_generation
from tests.dcs.sync_worker import digest, weights

torch.set_num_threads(1)
PAUSED_HEALTH_S = 20.0


def custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 30.0,
):
    """The group as SGLang 0.5.23 joins it (`WeightUpdater.init_weights_update_group` calls
    sglang/srt/utils/common.py `init_custom_process_group` with init_method tcp://address:port and rank =
    rank_offset + tp_rank): torch's tcp rendezvous, PrefixStore(group_name), then torch's own
    `_new_process_group_helper`, which adds its prefixes and registers the group, as SGLang's code does."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank_offset, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def receive_each(body: dict, group) -> dict[str, torch.Tensor]:
    """SGLang's default form (every release): each tensor allocated from its dtype name and shape, all broadcasts
    posted at once, then waited for."""
    received, handles = {}, []
    for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(torch.distributed.broadcast(t, src=0, group=group, async_op=True))
        received[name] = t
    for handle in handles:
        handle.wait()
    return received


def receive_flattened(release: str, body: dict, group) -> dict[str, torch.Tensor]:
    """`load_format: "flattened_bucket"`: one uint8 broadcast holding the call's tensors back to back, in order,
    with no padding; each tensor is then viewed out of it by byte range.
      0.5.23 (FlattenedTensorBucket.empty) checks every tensor before receiving anything: a negative dimension,
             a byte offset that is not a multiple of the tensor's dtype size, or no tensor at all is refused, and
             the broadcast is never joined (the sender waits out its deadline).
      0.5.6  allocates each tensor (a negative dimension fails there, before the broadcast), concatenates their
             bytes into the buffer, receives, and only then views the tensors out: a misaligned one fails after
             the broadcast."""
    dtypes = [getattr(torch, d) for d in body["dtypes"]]
    shapes = [torch.Size(s) if release == "0.5.23" else s for s in body["shapes"]]
    if release == "0.5.23":
        layout, offset = [], 0
        for name, dtype, shape in zip(body["names"], dtypes, shapes, strict=True):
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in {name}: {list(shape)}")
            if offset % dtype.itemsize:
                raise ValueError(f"{name} is not aligned: byte offset {offset}, dtype {dtype}")
            layout.append((name, dtype, shape, offset, offset + shape.numel() * dtype.itemsize))
            offset = layout[-1][4]
        if not layout:
            raise ValueError("an empty bucket")
        buffer = torch.empty(offset, dtype=torch.uint8)
    else:
        parts = [torch.empty(shape, dtype=dtype) for dtype, shape in zip(dtypes, shapes)]
        sizes = [p.numel() * p.element_size() for p in parts]
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        layout = [
            (n, d, p.shape, end - size, end) for n, d, p, size, end in zip(body["names"], dtypes, parts, sizes, ends)
        ]
        buffer = torch.cat([p.flatten().view(torch.uint8) for p in parts])
    torch.distributed.broadcast(buffer, src=0, group=group)
    return {name: buffer[start:end].view(dtype).reshape(shape) for name, dtype, shape, start, end in layout}


def build(
    release: str, fail_version: str | None, model_path: str | None = None, lora: LoraArgs | None = None
) -> FastAPI:
    """The stand-in of `release`; with `model_path` (a model directory) it also generates, and serves LoRA
    adapters as `lora` says (tests/dcs/sglang_generation.py)."""
    app = FastAPI()
    lora = lora or LoraArgs()
    state = {
        "weights": weights(0, torch.float32),
        "version": "default",
        "groups": {},
        "pauses": [],
        "continues": 0,
        "paused": False,
        "updating": False,
        "serving": True,
        "updates": 0,
        "calls": [],
    }

    def ok(message: str = "ok"):
        return {"success": True, "message": message}

    def bad(message: str):
        return JSONResponse({"success": False, "message": message}, status_code=400)

    @app.get("/health")
    async def health():
        if state["paused"]:  # SGLang's probe generation waits out its 20 s timeout while paused, then says 503
            await asyncio.sleep(PAUSED_HEALTH_S)
            return JSONResponse({}, status_code=503)
        return JSONResponse({}, status_code=200 if state["serving"] else 503)

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await request.body()
        if release == "0.5.5":
            if body:  # 0.5.5 takes no body
                return JSONResponse({"detail": "unexpected body"}, status_code=422)
            mode = "abort"
        else:
            mode = (await request.json()).get("mode", "abort") if body else "abort"
            if mode not in ("abort", "in_place", "retract"):
                return bad(f"unknown mode {mode}")
        state["pauses"].append(mode)
        state["paused"] = True
        return {"message": "paused", "status": "ok"}

    @app.post("/continue_generation")
    async def cont():
        state["continues"] += 1
        state["paused"] = False
        return {"message": "continued", "status": "ok"}

    @app.post("/init_weights_update_group")
    def init_group(body: dict):
        try:
            group = custom_process_group(
                body.get("backend", "gloo"),
                body["master_address"],
                body["master_port"],
                body["rank_offset"],
                body["world_size"],
                body["group_name"],
            )
        except Exception as exc:
            return bad(f"Failed to initialize custom process group: {exc}.")
        state["groups"][body["group_name"]] = group
        return ok("Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    def destroy(body: dict):
        group = state["groups"].pop(body["group_name"], None)
        if group is not None:
            torch.distributed.destroy_process_group(group)
        return ok()

    if release == "0.5.23":

        @app.post("/begin_weight_update")
        async def begin():
            if state["updating"]:  # 0.5.23 refuses a second begin without an end
                return bad("a weight update is already in progress; send /end_weight_update first")
            state["updating"] = True
            return ok()

        @app.post("/end_weight_update")
        async def end():
            state["updating"] = False
            return ok()

    @app.post("/update_weights_from_distributed")
    def update(body: dict):
        if release == "0.5.23" and not state["updating"]:
            return bad("update_weights_from_distributed outside begin/end_weight_update")
        group = state["groups"].get(body["group_name"])
        if group is None:
            return bad(f"no group {body['group_name']}")
        # 0.5.5's request has no load_format field: it is dropped, and every tensor is its own broadcast
        flattened = release != "0.5.5" and body.get("load_format") == "flattened_bucket"
        try:
            received = receive_flattened(release, body, group) if flattened else receive_each(body, group)
        except Exception as exc:  # each release answers success: false (HTTP 400), naming the error
            return bad(f"the weights were not received: {exc}")
        state["calls"].append(
            {
                "load_format": body.get("load_format"),
                "names": len(body["names"]),
                "broadcasts": 1 if flattened else len(body["names"]),
            }
        )
        if fail_version is not None and body.get("weight_version") == fail_version:
            state["serving"] = False  # partially written: must not serve until a full update succeeds
            return bad("weights partially written; update failed")
        state["weights"].update(received)
        state["updates"] += 1
        state["serving"] = True
        # 0.5.6 records no weight_version for an update made while paused (0.5.23 does)
        if body.get("weight_version") is not None and not (release == "0.5.6" and state["paused"]):
            state["version"] = body["weight_version"]
        return ok("updated")

    if release != "0.5.5":

        @app.post("/update_weight_version")
        async def update_weight_version(body: dict):
            state["version"] = body["new_version"]
            return ok()

    if release in ("0.5.5", "0.5.6"):

        @app.get("/get_weight_version")
        async def get_version():
            return {"weight_version": state["version"]}

    if release != "0.5.5":

        @app.get("/weight_version")
        async def version():
            if release == "0.5.23":
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {"weight_version": state["version"]}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        info = {"model_path": "stand-in", "is_generation": True}
        if release == "0.5.23":
            info["weight_version"] = state["version"]
        return info

    # the server info: its arguments (dtype "auto": the model's own) and the release; /server_info from 0.5.6 on
    serving = add_generation(app, state, model_path, lora) if model_path and os.path.isdir(model_path) else None

    @app.get("/get_server_info")
    async def get_server_info():
        return {"dtype": "auto", "version": release, **dataclasses.asdict(lora)}

    if release != "0.5.5":
        app.get("/server_info")(get_server_info)

    @app.get("/stats")
    async def stats():
        return {
            "pauses": state["pauses"],
            "continues": state["continues"],
            "version": state["version"],
            "digest": digest(state["weights"]),
            "serving": state["serving"],
            "updates": state["updates"],
            "calls": state["calls"],
            "lora": serving.events if serving else [],
            "generated": serving.generated if serving else [],
        }

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dcs", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--release", choices=["0.5.5", "0.5.6", "0.5.23"], default="0.5.6")
    p.add_argument("--fail-version", default=None)
    p.add_argument("--model-path", default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)
    args = p.parse_args()
    dcs = DCSClient(args.dcs)
    node = dcs.register(
        NodeRegistration(role="engine", host="127.0.0.1", ports={"http": args.port}, run_id=args.run_id)
    )

    def beat():
        while True:
            try:
                dcs.heartbeat(node.node_id, Heartbeat())
            except Exception:
                pass
            time.sleep(0.2)

    threading.Thread(target=beat, daemon=True).start()
    lora = LoraArgs(args.enable_lora, args.max_lora_rank, args.lora_target_modules)
    uvicorn.run(
        build(args.release, args.fail_version, args.model_path, lora),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
