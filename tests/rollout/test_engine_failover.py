"""The rollout's EnginePool when an engine hangs (a process stopped with SIGSTOP: connections accepted, nothing
answered), against in-memory engines (tests/fakes/engines.py): once its version long poll times out, it gets no
new requests and the requests it holds are sent to another engine, so generation goes on there."""

from __future__ import annotations

import asyncio

from services.rollout.engine_pool import EnginePool
from tests.fakes.engines import FakeEngines, sample_length, token


def test_the_requests_of_an_engine_that_stops_answering_go_to_another():
    async def scenario():
        fleet = FakeEngines()
        pool = EnginePool(["http://engine-0:1", "http://engine-1:1"], client=fleet.client)
        watcher = asyncio.create_task(pool.watch_versions(wait_s=0.2, poll_s=0.05, on_change=lambda: None))
        await asyncio.sleep(0.05)
        fleet.stop("http://engine-1:1")
        samplings = [{"sampling_seed": s, "temperature": 1.0} for s in range(4)]
        groups = [pool.generate_group([1, 2, 3], samplings, 16, [f"g{g}-{s}" for s in range(4)]) for g in range(6)]
        done = await asyncio.wait_for(asyncio.gather(*groups), 10)
        watcher.cancel()
        return fleet, pool, done

    fleet, pool, done = asyncio.run(scenario())
    assert fleet.hung, "no request went to the stopped engine before it was found out"
    assert {r.url for r in fleet.requests} == {"http://engine-0:1"}  # what was answered, engine-0 answered
    assert pool.reachable == [True, False] and pool.in_flight == [0, 0]
    hung_rids = {rid for r in fleet.hung for rid in r.rids}
    answered_rids = {rid for r in fleet.requests for rid in r.rids}
    assert hung_rids <= answered_rids  # every request the stopped engine held was sent again
    for group in done:
        for s, sample in enumerate(group):
            assert sample.output_ids == [token(s, j) for j in range(sample_length(s))]
