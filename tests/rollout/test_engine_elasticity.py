"""Engines joining and leaving the rollout's real EnginePool and EngineFleet, against in-memory engines
(tests/fakes/engines.py) and an in-memory engine directory (the coordinator's engine set): a joining engine gets
requests only once it serves the newest weights; a drained one gives up the requests it holds, which finish on
the others; the fleet follows the directory, keeps registrations for added engines only (each saying the version its
engine holds, and made again when the engine restarted; until it has one, the engine gets no requests), and leaves
alone the engines it started with until the directory has listed them."""

from __future__ import annotations

import asyncio

from services.dcs.client import DCSError
from services.dcs.models import EngineEntry, EngineList
from services.rollout.config import RolloutConfig
from services.rollout.engine_fleet import EngineFleet
from services.rollout.engine_pool import EnginePool
from tests.fakes import FakeMembership
from tests.fakes.engines import FakeEngines, sample_length, token

A, B, C = "http://engine-a:1", "http://engine-b:1", "http://engine-c:1"
SAMPLINGS = [{"sampling_seed": s, "temperature": 1.0} for s in range(4)]


def _groups(pool: EnginePool, first: int, count: int):
    return [
        pool.generate_group([1, 2, 3], SAMPLINGS, 16, [f"g{g}-{s}" for s in range(4)])
        for g in range(first, first + count)
    ]


def _complete(done) -> bool:
    return all(
        sample.output_ids == [token(s, j) for j in range(sample_length(s))]
        for group in done
        for s, sample in enumerate(group)
    )


def test_a_joining_engine_gets_requests_only_once_it_serves_the_newest_weights():
    async def scenario():
        fleet = FakeEngines()
        pool = EnginePool([A], client=fleet.client)
        watcher = asyncio.create_task(pool.watch_versions(wait_s=0.2, poll_s=0.02, on_change=lambda: None))
        fleet.set_version(3)
        await asyncio.sleep(0.05)
        fleet.lag(B, 0)  # joins with its initial weights
        pool.add(B)
        await asyncio.sleep(0.05)
        early = await asyncio.gather(*_groups(pool, 0, 6))
        fleet.catch_up(B)  # the trainer sent it version 3
        await asyncio.sleep(0.05)
        late = await asyncio.gather(*_groups(pool, 6, 12))
        watcher.cancel()
        return fleet, pool, early + late

    fleet, pool, done = asyncio.run(scenario())
    assert _complete(done)
    to_b = [r for r in fleet.requests if r.url == B]
    assert to_b and all(r.version == 3 for r in to_b)  # never under its older weights
    assert {r.url for r in fleet.requests[:6]} == {A}
    described = {e["url"]: e for e in pool.describe()}
    assert described[B]["joined_at_version"] == 3 and described[B]["first_version"] == 3
    assert described[B]["state"] == "serving" and described[B]["requests"] == len(to_b)


def test_a_drained_engine_gives_up_its_requests_and_they_finish_on_the_others():
    async def scenario():
        fleet = FakeEngines()
        pool = EnginePool([A, B], client=fleet.client)
        watcher = asyncio.create_task(pool.watch_versions(wait_s=5.0, poll_s=0.02, on_change=lambda: None))
        await asyncio.sleep(0.05)
        fleet.stop(B)  # it holds what it is sent (its version poll answers within its 5 s wait: still "reachable")
        groups = [asyncio.ensure_future(g) for g in _groups(pool, 0, 6)]
        while not fleet.hung:
            await asyncio.sleep(0.01)
        held = pool.describe()[1]["in_flight"]
        pool.drain(B)
        done = await asyncio.wait_for(asyncio.gather(*groups), 10)
        await asyncio.sleep(0.1)
        watcher.cancel()
        return fleet, pool, done, held

    fleet, pool, done, held = asyncio.run(scenario())
    assert held > 0 and _complete(done)
    assert pool.urls == [A]
    hung_rids = {rid for r in fleet.hung for rid in r.rids}
    assert hung_rids <= {rid for r in fleet.requests if r.url == A for rid in r.rids}
    assert next(c for c in fleet.clients if c.url == B).closed


class Directory:
    """The coordinator's engine set, in memory: add (409 for a removed URL from the rollout's own list), list."""

    def __init__(self):
        self.entries: list[EngineEntry] = []
        self.removed: set[str] = set()

    def add_engine(self, run_id: str, url: str, initial: bool = False) -> EngineEntry:
        if initial and url in self.removed:
            raise DCSError(409, f"engine {url} was removed")
        entry = EngineEntry(url=url, source="added", rank=len(self.entries))
        self.entries.append(entry)
        return entry

    def engines(self, run_id: str) -> EngineList:
        return EngineList(engines=list(self.entries), removed=sorted(self.removed))


def test_the_fleet_follows_the_run_s_engine_set():
    memberships: list[FakeMembership] = []

    def join(dcs, registration):
        memberships.append(FakeMembership(dcs, registration))
        return memberships[-1]

    async def scenario():
        fleet_engines = FakeEngines()
        directory = Directory()
        directory.removed.add(C)  # removed earlier: the rollout's own list does not bring it back
        config = RolloutConfig(run_id="r", engine_url=f"{A},{C}")
        pool = EnginePool(config.engine_urls, client=fleet_engines.client)
        fleet = EngineFleet(config, pool, directory, join)
        await fleet.start()
        after_start = (pool.urls, [(m.registration.host, m.registration.weight_version) for m in memberships])
        directory.add_engine("r", B)  # added over REST
        directory.entries.append(EngineEntry(url="http://engine-d:1", source="self", rank=0, alive=True))
        await fleet.reconcile()
        after_add = (list(pool.urls), sorted(fleet.memberships))
        directory.entries = [e for e in directory.entries if e.url != A]  # removed over REST
        directory.entries[-1] = directory.entries[-1].model_copy(update={"alive": False})  # its lease lapsed
        await fleet.reconcile()
        after_remove = (list(pool.urls), sorted(fleet.memberships), [m.closed for m in memberships])
        await fleet.close()
        await pool.aclose()
        return after_start, after_add, after_remove

    after_start, after_add, after_remove = asyncio.run(scenario())
    assert after_start == ([A], [("engine-a", 0)])  # C drained: it was listed nowhere but removed
    assert after_add == ([A, B, "http://engine-d:1"], [A, B])  # one registering itself needs no membership
    assert after_remove == ([B], [B], [True, False])  # A's registration closed, B's kept
    assert all(m.closed for m in memberships)  # and every one when the rollout stops


def test_an_added_engine_registers_saying_the_version_it_holds_and_again_when_it_restarts():
    memberships: list[FakeMembership] = []

    def join(dcs, registration):
        memberships.append(FakeMembership(dcs, registration))
        return memberships[-1]

    def registrations() -> list[tuple[int | None, bool]]:
        return [(m.registration.weight_version, m.closed) for m in memberships]

    async def settle(fleet: EngineFleet) -> None:
        await asyncio.sleep(0.1)  # the pool's watch sees the version
        fleet.report()
        await fleet.reconcile()

    async def scenario():
        engines = FakeEngines()
        engines.set_version(4)  # the engine holds version 4 as the rollout starts (a restarted rollout)
        directory = Directory()
        config = RolloutConfig(run_id="r", engine_url=f"{A},{B}")
        engines.stop(B)  # does not answer: not registered until it does
        pool = EnginePool(config.engine_urls, client=engines.client)
        fleet = EngineFleet(config, pool, directory, join)
        await fleet.start()
        watcher = asyncio.create_task(pool.watch_versions(wait_s=0.2, poll_s=0.02, on_change=lambda: None))
        at_start = registrations()
        held_at_start = {e["url"]: e["state"] for e in pool.describe()}[B]
        engines.set_version(5)  # a sync reached it: its record moves by the sync's report, not by the rollout
        await settle(fleet)
        after_sync = registrations()
        engines.lag(A, 0)  # restarted: back with its initial weights
        engines.set_version(5)  # its long poll answers
        await settle(fleet)
        after_restart = registrations()
        engines.stopped.discard(B)  # answers now
        await settle(fleet)
        b_answers = registrations()
        b_state = {e["url"]: e["state"] for e in pool.describe()}[B]
        watcher.cancel()
        await fleet.close()
        await pool.aclose()
        return at_start, after_sync, after_restart, b_answers, (held_at_start, b_state)

    at_start, after_sync, after_restart, b_answers, b_states = asyncio.run(scenario())
    assert at_start == [(4, False)]  # A, with the version it holds; B not yet
    # B gets no requests until registered (no publish would reach it), then serves
    assert b_states == ("registering", "serving")
    assert after_sync == [(4, False)]  # the same registration
    assert after_restart == [(4, True), (0, False)]  # the old one closed, a new one saying its initial weights
    assert b_answers == [(4, True), (0, False), (5, False)]
