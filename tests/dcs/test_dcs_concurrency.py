"""The coordinator under many clients at once, as a real process: 200 long polls of /weights/next wait
together and all answer the moment a version is published (none refused, none timed out)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.dcs.models import RunConfig, WeightMetadata

pytestmark = pytest.mark.slow

LONG_POLLS = 200


def test_two_hundred_long_polls_wait_together_and_all_see_the_new_version(dcs, client):
    client.create_run(RunConfig(name="many", model="/m"))
    tensor = {"name": "w", "dtype": "float32", "shape": [2], "bucket": 0, "offset": 0, "nbytes": 8}

    async def main():
        limits = httpx.Limits(max_connections=LONG_POLLS + 10, max_keepalive_connections=LONG_POLLS + 10)
        async with httpx.AsyncClient(base_url=dcs.url, limits=limits, timeout=60) as http:
            polls = [
                asyncio.create_task(http.get("/v1/runs/many/weights/next", params={"after": 0, "wait_s": 30}))
                for _ in range(LONG_POLLS)
            ]
            await asyncio.sleep(2.0)  # every poll is waiting
            assert not any(p.done() for p in polls)
            meta = WeightMetadata(version=1, tensors=[tensor], bucket_bytes=[8])
            published = await http.post(
                "/v1/runs/many/weights", content=meta.model_dump_json(), headers={"content-type": "application/json"}
            )
            assert published.status_code == 201
            answers = await asyncio.wait_for(asyncio.gather(*polls), 20)
        return answers

    answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * LONG_POLLS
    assert {a.json()["version"] for a in answers} == {1}
