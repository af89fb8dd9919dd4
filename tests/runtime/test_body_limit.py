"""BodyLimit (in front of every HTTP service): bodies over the cap get 413 before any route runs, declared
(Content-Length) or streamed (chunked); bodies within it reach the route whole."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request

from services.runtime.body_limit import BodyLimit


def _app(seen: list[int]) -> BodyLimit:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        seen.append(len(body))
        return {"bytes": len(body)}

    return BodyLimit(app, max_bytes=1000)


async def _post(app, content, headers=None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/echo", content=content, headers=headers)


def test_a_body_within_the_cap_reaches_the_route_whole():
    seen: list[int] = []
    r = asyncio.run(_post(_app(seen), b"x" * 1000))
    assert r.status_code == 200 and r.json() == {"bytes": 1000} and seen == [1000]


def test_a_declared_body_over_the_cap_is_refused_before_the_route():
    seen: list[int] = []
    r = asyncio.run(_post(_app(seen), b"x" * 1001))
    assert r.status_code == 413 and "over 1000 bytes" in r.json()["detail"] and seen == []
    r = asyncio.run(_post(_app(seen), b"x", headers={"content-length": "junk"}))
    assert r.status_code == 413 and seen == []


def test_a_streamed_body_is_counted_and_refused_at_the_cap():
    seen: list[int] = []

    async def chunks():
        for _ in range(50):  # no Content-Length: 50 x 100 bytes, chunked
            yield b"y" * 100

    r = asyncio.run(_post(_app(seen), chunks()))
    assert r.status_code == 413 and seen == []
