"""A minimal receiver process that speaks the SGLang weight-update endpoints exactly as
../shared/SGLANG_PROTOCOL.md states, standing in for a real SGLang server (which cannot run here)
until the built-in engine lands. It emulates the release differences the client must cope with.

    python -m tests.dcs.sglang_receiver --port P --dcs URL --run-id R --release 0.5.6 [--fail-version V]

It registers itself with DCS as an engine node and heartbeats. /stats (not SGLang) lets tests read
what happened: pause/continue calls, the weights' digest and the weight version."""

from __future__ import annotations

import argparse
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.dcs.client import DCSClient
from services.dcs.models import Heartbeat, NodeRegistration
from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.layout import TORCH_DTYPES
from tests.dcs.sync_worker import digest, weights

torch.set_num_threads(1)


def build(release: str, fail_version: str | None) -> FastAPI:
    app = FastAPI()
    state = {"weights": weights(0, torch.float32), "version": "default", "groups": {}, "pauses": [],
             "continues": 0, "paused": False, "updating": False, "serving": True, "updates": 0}

    def ok(message: str = "ok"):
        return {"success": True, "message": message}

    def bad(message: str):
        return JSONResponse({"success": False, "message": message}, status_code=400)

    @app.get("/health")
    async def health():
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
        group = BroadcastGroup.open(body["group_name"], body.get("backend", "gloo"), body["master_address"],
                                    body["master_port"], body["rank_offset"], body["world_size"], 30.0)
        state["groups"][body["group_name"]] = group
        return ok("joined")

    @app.post("/destroy_weights_update_group")
    def destroy(body: dict):
        group = state["groups"].pop(body["group_name"], None)
        if group:
            group.close()
        return ok()

    if release == "0.5.23":
        @app.post("/begin_weight_update")
        async def begin():
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
        received = {}
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            t = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
            group.broadcast(t, 0)
            received[name] = t
        if fail_version is not None and body.get("weight_version") == fail_version:
            state["serving"] = False  # partially written: must not serve until a full update succeeds
            return bad("weights partially written; update failed")
        state["weights"].update(received)
        state["updates"] += 1
        state["serving"] = True
        if body.get("weight_version") is not None:
            state["version"] = body["weight_version"]
        return ok("updated")

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

    @app.get("/model_info")
    async def model_info():
        info = {"model_path": "stand-in", "is_generation": True}
        if release == "0.5.23":
            info["weight_version"] = state["version"]
        return info

    @app.get("/stats")
    async def stats():
        return {"pauses": state["pauses"], "continues": state["continues"], "version": state["version"],
                "digest": digest(state["weights"]), "serving": state["serving"], "updates": state["updates"]}

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dcs", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--release", choices=["0.5.5", "0.5.6", "0.5.23"], default="0.5.6")
    p.add_argument("--fail-version", default=None)
    args = p.parse_args()
    dcs = DCSClient(args.dcs)
    node = dcs.register(NodeRegistration(role="engine", host="127.0.0.1", ports={"http": args.port},
                                         run_id=args.run_id))

    def beat():
        while True:
            try:
                dcs.heartbeat(node.node_id, Heartbeat())
            except Exception:
                pass
            time.sleep(0.2)

    threading.Thread(target=beat, daemon=True).start()
    uvicorn.run(build(args.release, args.fail_version), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
