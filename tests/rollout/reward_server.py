"""A small remote reward endpoint for test_rewards.py, run as a real process:

python -m tests.rollout.reward_server --port P

POST /score          {"reward": 1.0 if the stripped response equals fields["label"] else 0.0}
POST /flaky?fail=K   503 for the first K requests of each fields["key"], then /score
POST /slow?sleep_s=S sleeps S seconds, then /score
POST /reject         422 (the request's fault: must not be retried)
POST /auth           401 unless "authorization: Bearer secret", then /score
POST /nan            {"reward": NaN}
POST /not_a_number   {"reward": "high"}
GET  /requests/KEY   how many requests with fields["key"] == KEY each path got, and the last body
                     and authorization header"""

from __future__ import annotations

import argparse
import asyncio
from collections import defaultdict

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


def build() -> FastAPI:
    app = FastAPI()
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    last: dict[str, dict] = {}

    async def arrived(request: Request) -> tuple[dict, int]:
        body = await request.json()
        key = str(body.get("fields", {}).get("key", ""))
        counts[key][request.url.path] += 1
        last[key] = {"body": body, "authorization": request.headers.get("authorization")}
        return body, counts[key][request.url.path]

    def reward(body: dict) -> dict:
        return {"reward": float(body["response"].strip() == body["fields"].get("label"))}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/requests/{key}")
    async def requests(key: str):
        return {"counts": counts[key], **last.get(key, {})}

    @app.post("/score")
    async def score(request: Request):
        body, _ = await arrived(request)
        return reward(body)

    @app.post("/flaky")
    async def flaky(request: Request, fail: int):
        body, n = await arrived(request)
        if n <= fail:
            return JSONResponse({"detail": f"overloaded ({n})"}, status_code=503)
        return reward(body)

    @app.post("/slow")
    async def slow(request: Request, sleep_s: float):
        body, _ = await arrived(request)
        await asyncio.sleep(sleep_s)
        return reward(body)

    @app.post("/reject")
    async def reject(request: Request):
        await arrived(request)
        return JSONResponse({"detail": "fields.label is required"}, status_code=422)

    @app.post("/auth")
    async def auth(request: Request):
        body, _ = await arrived(request)
        if request.headers.get("authorization") != "Bearer secret":
            return JSONResponse({"detail": "bad token"}, status_code=401)
        return reward(body)

    @app.post("/nan")
    async def nan(request: Request):
        await arrived(request)
        return Response('{"reward": NaN}', media_type="application/json")

    @app.post("/not_a_number")
    async def not_a_number(request: Request):
        await arrived(request)
        return {"reward": "high"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # requests left sleeping in /slow by a client that timed out must not hold up SIGTERM
    uvicorn.run(build(), host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
