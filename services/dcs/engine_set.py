"""A run's engine set, in Redis beside the rest of its state (R = run id, under state.py's run key):

  K:run:R:engines           HASH  url -> rank: engines added through the REST API or the rollout's --engine-url
  K:run:R:engines:removed   SET   urls taken out of the run: such an engine cannot register for it again
  K:run:R:engines:rank      STRING the next rank to give

The run's engines are the added URLs and the engine nodes that registered themselves for the run (a built-in
engine with --dcs-url). The rollout follows this set (services/rollout/engine_fleet.py); the trainer's weight
syncs reach the engine nodes, as before."""

from __future__ import annotations

from services.dcs.models import EngineAdd, EngineEntry, EngineList, NodeInfo, NodeRegistration, engine_url
from services.dcs.state import Conflict, Missing, RedisState

# Add a URL unless (for the rollout's own list) it was removed; adding clears a removal. Returns its rank,
# or -1 when skipped.
_ADD = """
if ARGV[2] == '1' and redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return -1 end
local rank = redis.call('HGET', KEYS[1], ARGV[1])
if rank then return tonumber(rank) end
rank = redis.call('INCR', KEYS[3]) - 1
redis.call('HSET', KEYS[1], ARGV[1], rank)
redis.call('SREM', KEYS[2], ARGV[1])
return rank
"""


class EngineSets:
    def __init__(self, state: RedisState):
        self.state = state
        self._add = state.redis.register_script(_ADD)

    def _keys(self, run_id: str) -> list[str]:
        base = f"{self.state.run_key(run_id)}:engines"
        return [base, f"{base}:removed", f"{base}:rank"]

    async def add(self, run_id: str, add: EngineAdd) -> EngineEntry | None:
        """The entry of the added engine; None when `add.initial` and the URL was removed from the run."""
        await self.state.run(run_id)  # Missing: no such run
        rank = await self._add(keys=self._keys(run_id), args=[add.url, "1" if add.initial else "0"])
        if rank < 0:
            return None
        await self.state.redis.publish(self.state.events_channel, "topology")
        return next(e for e in (await self.listing(run_id)).engines if e.url == add.url)

    async def remove(self, run_id: str, url: str) -> list[str]:
        """Take `url` out of the run (whichever way it joined) and unregister its nodes; their node ids. An URL
        that is not among the run's engines is Missing."""
        url = engine_url(url)
        listing = await self.listing(run_id)
        entries = [e for e in listing.engines if e.url == url]
        if not entries:
            raise Missing(f"run {run_id} has no engine {url}")
        added, removed, _ = self._keys(run_id)
        async with self.state.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(added, url)
            pipe.sadd(removed, url)
            await pipe.execute()
        node_ids = [n.node_id for n in await self._nodes(run_id) if _url_of(n) == url]
        for node_id in node_ids:
            await self.state.unregister(node_id)
        return node_ids

    async def listing(self, run_id: str) -> EngineList:
        """Added engines first (by rank), then the ones that registered themselves; a URL appears once, with
        its alive registration when it has one."""
        await self.state.run(run_id)
        added_key, removed_key, _ = self._keys(run_id)
        async with self.state.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(added_key)
            pipe.smembers(removed_key)
            added, removed = await pipe.execute()
        nodes = await self._nodes(run_id)
        entries = [
            self._entry(url, "added", int(rank), nodes)
            for url, rank in sorted(added.items(), key=lambda kv: int(kv[1]))
        ]
        seen = set(added)
        for node in nodes:
            url = _url_of(node)
            if url not in seen and url not in removed:
                seen.add(url)
                entries.append(self._entry(url, "self", node.rank, nodes))
        return EngineList(engines=entries, removed=sorted(removed))

    @staticmethod
    def _entry(url: str, source: str, rank: int, nodes: list[NodeInfo]) -> EngineEntry:
        mine = sorted((n for n in nodes if _url_of(n) == url), key=lambda n: (n.alive, n.last_heartbeat))
        node = mine[-1] if mine else None
        return EngineEntry(
            url=url,
            source=source,
            rank=rank,
            node_id=node.node_id if node else None,
            alive=bool(node and node.alive),
            weight_version=node.weight_version if node else None,
        )

    async def _nodes(self, run_id: str) -> list[NodeInfo]:
        return [n for n in await self.state.nodes() if n.role == "engine" and n.run_id == run_id and n.url()]

    async def refuse_removed(self, reg: NodeRegistration) -> None:
        """Conflict when `reg` is an engine whose URL was taken out of its run: a removed engine (or the rollout
        that kept it registered) must not slip back in by registering again."""
        if reg.role != "engine" or reg.url() is None:
            return
        url = _url_of(reg)
        if await self.state.redis.sismember(self._keys(reg.run_id)[1], url):
            raise Conflict(
                f"engine {url} was removed from run {reg.run_id}; add it again with "
                f"`sluice engines add {url}` (POST /v1/runs/{reg.run_id}/engines)"
            )


def _url_of(node: NodeRegistration) -> str:
    return engine_url(node.url() or "")
