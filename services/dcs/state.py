"""All coordinator state, in Redis. Each mutation is one transaction or script, so replicas and a
restarted coordinator see one truth. Timestamps come from Redis's clock, not the replica's.

Key layout (K = --key-prefix, R = run id):
  K:nodes, K:beats          HASH  node id -> registration / last heartbeat (each names its run)
  K:held                    HASH  engine node id -> the weight version it holds: said at its registration, then
                                  set by each ok sync report that names it (the one record of engine versions)
  K:runs                    HASH  run id -> Run (config, desired state, pause_seq, lifecycle status, failure)
  K:group_generation        STRING counter shared by every run's sync groups (names stay unique)
  K:run:R:weights:latest    STRING the run's newest published version
  K:run:R:weights:<V>       STRING version V's metadata;  K:run:R:weights:versions ZSET of live versions
  K:run:R:cursors           HASH  receiver role -> version it has loaded
  K:run:R:group             STRING the run's current sync group (and its membership key)
  K:run:R:syncs             LIST  the run's newest 1000 sync reports
  K:run:R:failures          LIST  failures reported after the run's first (the newest 10)
  K:run:R:steps             HASH  step -> the metrics the trainer reported of it (step_records.py)
  K:run:R:progress          STRING the trainer's progress as it last reported it (step_records.py)
  K:run:R:engines...        the run's engine set (engine_set.py)
  K:events                  pub/sub: topology, runs, groups, weights:R
The sync group and sync reports are sync_groups.py's. A node dead for --dead-node-ttl-s is dropped from
K:nodes/K:beats; DELETE /v1/runs/R drops K:run:R:* and the roles' run state under sluice:R:* (the run's
namespace: services/run_contract/run_keys.py)."""

from __future__ import annotations

import json
import uuid
from typing import Callable, cast

import redis.asyncio as aioredis

from services.dcs.models import (
    ENDED,
    Failure,
    Heartbeat,
    NodeInfo,
    NodeRegistration,
    PublishedWeights,
    Run,
    RunConfig,
    WeightMetadata,
)
from services.run_contract.run_keys import coordinator_run_key, run_key_patterns
from services.runtime.redis_clients import async_redis


class Conflict(Exception):
    """-> HTTP 409"""


class Missing(Exception):
    """-> HTTP 404"""


# Publish version V only if it is newer than the latest: versions are monotonic across replicas.
_PUBLISH = """
local latest = tonumber(redis.call('GET', KEYS[1]) or '0')
local v = tonumber(ARGV[1])
if v <= latest then return latest end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], v, ARGV[1])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[4], ARGV[3])
return -1
"""


# A heartbeat of a registered node only: one that was unregistered meanwhile leaves no orphan beat. An engine's
# heartbeat says no version (ARGV[3] = '1' when this one does): its version is K:held's, nobody else's.
_HEARTBEAT = """
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record then return false end
if ARGV[3] == '1' and cjson.decode(record)['role'] == 'engine' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return record
"""

# Move a role's cursor forward and collect the metadata every role is past, in one step: no replica can
# interleave a cursor move between another's read of the cursors and its deletes.
_SET_CURSOR = """
local latest = tonumber(redis.call('GET', KEYS[1]) or '0')
local v = tonumber(ARGV[2])
if v > latest then return {'never', tostring(latest)} end
local current = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if v < current then return {'backwards', tostring(current)} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local all = redis.call('HGETALL', KEYS[2])
local floor = latest
for i = 2, #all, 2 do floor = math.min(floor, tonumber(all[i])) end
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. floor)
for _, version in ipairs(stale) do
  redis.call('DEL', ARGV[3] .. version)
  redis.call('ZREM', KEYS[3], version)
end
return {'ok', cjson.encode(all)}
"""


class RedisState:
    def __init__(self, redis_url: str, prefix: str, node_lease_s: float, dead_node_ttl_s: float = 3600.0):
        self.redis = async_redis(redis_url)
        self.k = prefix
        self.node_lease_s = node_lease_s
        self.dead_node_ttl_s = max(dead_node_ttl_s, node_lease_s)
        self.events_channel = f"{prefix}:events"
        self._publish = self.redis.register_script(_PUBLISH)
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._set_cursor = self.redis.register_script(_SET_CURSOR)

    async def close(self) -> None:
        await self.redis.aclose()

    async def now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1e6

    async def _notify(self, topic: str) -> None:
        await self.redis.publish(self.events_channel, topic)

    # ------------------------------------------------------------ nodes

    async def register(self, reg: NodeRegistration) -> NodeInfo:
        node_id = uuid.uuid4().hex[:16]
        now = await self.now()
        record = {**reg.model_dump(exclude={"weight_version"}), "node_id": node_id, "registered_at": now}
        beat = {"ts": now, "step": None, "weight_version": None, "paused_seq": 0, "error": None}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(f"{self.k}:nodes", node_id, json.dumps(record))
            pipe.hset(f"{self.k}:beats", node_id, json.dumps(beat))
            if reg.weight_version is not None:  # an engine (models.py): what it holds as it joins
                pipe.hset(f"{self.k}:held", node_id, reg.weight_version)
            pipe.publish(self.events_channel, "topology")
            await pipe.execute()
        return self._node(record, beat, now, reg.weight_version)

    def _node(self, record: dict, beat: dict, now: float, held: int | str | bytes | None) -> NodeInfo:
        """An engine's version is the record's (K:held); any other node's, its last heartbeat's."""
        version = (None if held is None else int(held)) if record["role"] == "engine" else beat.get("weight_version")
        return NodeInfo(
            **record,
            last_heartbeat=beat["ts"],
            alive=now - beat["ts"] <= self.node_lease_s,
            step=beat.get("step"),
            weight_version=version,
            paused_seq=beat.get("paused_seq") or 0,
            error=beat.get("error"),
        )

    async def heartbeat(self, node_id: str, hb: Heartbeat) -> NodeInfo:
        now = await self.now()
        beat = {"ts": now, **hb.model_dump()}
        record = await self._heartbeat(
            keys=[f"{self.k}:nodes", f"{self.k}:beats"],
            args=[node_id, json.dumps(beat), "1" if hb.weight_version is not None else ""],
        )
        if record is None:
            raise Missing(f"node {node_id} is not registered (re-register after a coordinator reset)")
        if record == 0:
            raise Conflict(
                f"node {node_id} is an engine: its weight version is recorded from its registration and "
                "the weight syncs that reach it, not from heartbeats (send the heartbeat without it)"
            )
        return self._node(json.loads(record), beat, now, await self.redis.hget(f"{self.k}:held", node_id))

    async def unregister(self, node_id: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(f"{self.k}:nodes", node_id)
            pipe.hdel(f"{self.k}:beats", node_id)
            pipe.hdel(f"{self.k}:held", node_id)
            pipe.publish(self.events_channel, "topology")
            removed, *_ = await pipe.execute()
        return bool(removed)

    async def nodes(self) -> list[NodeInfo]:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(f"{self.k}:nodes")
            pipe.hgetall(f"{self.k}:beats")
            pipe.hgetall(f"{self.k}:held")
            records, beats, held = await pipe.execute()
        now = await self.now()
        out, expired = [], []
        for node_id, text in records.items():
            beat = json.loads(beats.get(node_id) or '{"ts": 0}')
            if now - beat["ts"] > self.dead_node_ttl_s:
                expired.append(node_id)  # dead long ago: forgotten, so topology does not grow without bound
                continue
            out.append(self._node(json.loads(text), beat, now, held.get(node_id)))
        if expired:
            for key in ("nodes", "beats", "held"):
                await self.redis.hdel(f"{self.k}:{key}", *expired)
        return sorted(out, key=lambda n: (n.role, n.rank, n.node_id))

    async def node(self, node_id: str) -> NodeInfo:
        for n in await self.nodes():
            if n.node_id == node_id:
                return n
        raise Missing(f"node {node_id} is not registered")

    # ------------------------------------------------------------ weights (per run)

    def run_key(self, run_id: str) -> str:
        """Every piece of the coordinator's state of a run (weights, cursors, group, syncs, steps) lives under this
        prefix."""
        return coordinator_run_key(self.k, run_id)

    @staticmethod
    def weights_topic(run_id: str) -> str:
        return f"weights:{run_id}"

    async def publish(self, run_id: str, meta: WeightMetadata) -> PublishedWeights:
        published = PublishedWeights(**meta.model_dump(), published_at=await self.now())
        rk = self.run_key(run_id)
        latest = await self._publish(
            keys=[
                f"{rk}:weights:latest",
                f"{rk}:weights:{meta.version}",
                f"{rk}:weights:versions",
                self.events_channel,
            ],
            args=[meta.version, published.model_dump_json(), self.weights_topic(run_id)],
        )
        if int(latest) >= 0:
            raise Conflict(f"version {meta.version} is not newer than run {run_id}'s latest published version {latest}")
        return published

    async def latest_version(self, run_id: str) -> int:
        return int(await self.redis.get(f"{self.run_key(run_id)}:weights:latest") or 0)

    async def weights(self, run_id: str, version: int) -> PublishedWeights:
        text = await self.redis.get(f"{self.run_key(run_id)}:weights:{version}")
        if text is None:
            raise Missing(f"weight version {version} of run {run_id} is unknown or was collected")
        return PublishedWeights.model_validate_json(text)

    async def set_cursor(self, run_id: str, role: str, version: int) -> dict[str, int]:
        """A receiver role of the run says it has loaded `version` (0 at start declares the role). Metadata
        older than every declared role's cursor (and never the latest) is collected, so no role can clear
        what another still needs; a role moves only its own cursor, and only forward. One script."""
        rk = self.run_key(run_id)
        outcome, value = await self._set_cursor(
            keys=[f"{rk}:weights:latest", f"{rk}:cursors", f"{rk}:weights:versions"],
            args=[role, version, f"{rk}:weights:"],
        )
        if outcome == "never":
            raise Conflict(f"version {version} was never published in run {run_id} (latest is {value})")
        if outcome == "backwards":
            raise Conflict(f"role {role} of run {run_id} already consumed version {value}; cursors only move forward")
        flat = json.loads(value)
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def cursors(self, run_id: str) -> dict[str, int]:
        cursors = cast(dict[str, str], await self.redis.hgetall(f"{self.run_key(run_id)}:cursors"))  # decoded
        return {r: int(v) for r, v in cursors.items()}

    # ------------------------------------------------------------ runs

    async def create_run(self, config: RunConfig) -> Run:
        run = Run(run_id=config.name, config=config, desired_state="running", pause_seq=0, created_at=await self.now())
        if not await self.redis.hsetnx(f"{self.k}:runs", run.run_id, run.model_dump_json()):
            raise Conflict(f"run {run.run_id} exists")
        await self._notify("runs")
        return run

    async def run(self, run_id: str) -> Run:
        text = await self.redis.hget(f"{self.k}:runs", run_id)
        if text is None:
            raise Missing(f"run {run_id} does not exist")
        return Run.model_validate_json(text)

    async def delete_run(self, run_id: str) -> int:
        """Forget an ended run: its record, its weight/cursor/group/sync keys and the run state its roles keep
        beside them (`sluice:<run_id>:*`, in this Redis: services/run_contract/run_keys.py). Returns the keys deleted; a run
        that has not ended is Conflict (stop it first). The run id can then be used again, from scratch."""
        run = await self.run(run_id)
        if run.status not in ENDED:
            raise Conflict(f"run {run_id} is {run.status}: stop it before deleting it")
        deleted = 0
        for pattern in run_key_patterns(self.k, run_id):
            batch = []
            async for key in self.redis.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    deleted += await self.redis.delete(*batch)
                    batch = []
            if batch:
                deleted += await self.redis.delete(*batch)
        return deleted + await self.redis.hdel(f"{self.k}:runs", run_id)

    async def runs(self) -> list[Run]:
        return [Run.model_validate_json(t) for _, t in sorted((await self.redis.hgetall(f"{self.k}:runs")).items())]

    async def update_run(self, run_id: str, change: Callable[[Run], bool]) -> Run:
        """Read the run, apply `change` (True: it changed the run, write it back and notify; it may raise
        Conflict, which leaves the run as it was) and write it, in one optimistic transaction: replicas
        never lose each other's changes. The rules of each change are in lifecycle.py."""
        key = f"{self.k}:runs"
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    text = await pipe.hget(key, run_id)
                    if text is None:
                        raise Missing(f"run {run_id} does not exist")
                    run = Run.model_validate_json(text)
                    if not change(run):
                        await pipe.reset()
                        return run
                    pipe.multi()
                    pipe.hset(key, run_id, run.model_dump_json())
                    pipe.publish(self.events_channel, "runs")
                    await pipe.execute()
                    return run
                except aioredis.WatchError:
                    continue

    async def add_later_failure(self, run_id: str, failure: Failure) -> None:
        """A failure reported after the run's first: kept, the newest 10."""
        key = f"{self.run_key(run_id)}:failures"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(key, failure.model_dump_json())
            pipe.ltrim(key, 0, 9)
            await pipe.execute()

    async def later_failures(self, run_id: str) -> list[Failure]:
        texts = await self.redis.lrange(f"{self.run_key(run_id)}:failures", 0, -1)
        return [Failure.model_validate_json(t) for t in texts]
