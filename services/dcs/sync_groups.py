"""A run's weight-sync groups and sync reports, in the coordinator's Redis (state.py has the key layout): the
group for the source's live receivers (the same group while membership is unchanged) and each sync's report,
which records the version each engine it names now holds."""

from __future__ import annotations

import hashlib
import json

import redis.asyncio as aioredis

from services.dcs.models import GroupMember, SyncGroup, SyncGroupRequest, SyncReport
from services.dcs.state import Conflict, Missing, RedisState

# A sync report, and the version each engine it names now holds: only engines registered for the report's run
# (a report landing after an engine left, or re-registered under a new id, changes nothing).
_REPORT_SYNC = """
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, 999)
for i = 4, #ARGV do
  local record = redis.call('HGET', KEYS[2], ARGV[i])
  if record then
    local node = cjson.decode(record)
    if node['role'] == 'engine' and node['run_id'] == ARGV[3] then redis.call('HSET', KEYS[3], ARGV[i], ARGV[2]) end
  end
end
"""


class SyncGroups:
    def __init__(self, state: RedisState):
        self.state = state
        self._report_sync = state.redis.register_script(_REPORT_SYNC)

    async def sync_group(self, run_id: str, req: SyncGroupRequest) -> SyncGroup:
        """The group for the current live membership; the same group while membership is unchanged."""
        nodes = {n.node_id: n for n in await self.state.nodes()}
        source = nodes.get(req.source_node)
        if source is None or not source.alive:
            raise Missing(f"source node {req.source_node} is not a live registered node")
        if source.run_id != run_id:
            raise Conflict(f"source node {req.source_node} belongs to run {source.run_id}, not {run_id}")
        left_out = set(req.exclude_nodes)
        receivers = [
            n
            for n in nodes.values()
            if n.alive
            and n.role in req.receiver_roles
            and n.node_id != source.node_id
            and n.run_id == run_id
            and n.node_id not in left_out
        ]
        members = [GroupMember(node_id=source.node_id, role=source.role, rank=0, ranks=1)]
        next_rank = 1
        for n in sorted(receivers, key=lambda n: (n.role, n.rank, n.node_id)):
            width = max(1, int(n.parallel.get("tp", 1)))  # an engine joins as rank_offset + tp_rank
            members.append(
                GroupMember(
                    node_id=n.node_id,
                    role=n.role,
                    rank=next_rank,
                    ranks=width,
                    weights_dtype=n.weights_dtype,
                    gpu=n.gpu,
                )
            )
            next_rank += width
        # the port is not part of the identity: a reused group keeps the port it was created with
        key = hashlib.sha256(
            json.dumps([req.master_address, req.backend, [m.model_dump() for m in members]]).encode()
        ).hexdigest()
        return await self._store_group(run_id, key, req, members, next_rank)

    async def _store_group(
        self, run_id: str, key: str, req: SyncGroupRequest, members: list[GroupMember], world_size: int
    ) -> SyncGroup:
        current_key = f"{self.state.run_key(run_id)}:group"
        async with self.state.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(current_key)
                    current = await pipe.get(current_key)
                    if current and not req.new_group:
                        stored = json.loads(current)
                        if stored["key"] == key:
                            return SyncGroup(**stored["group"])
                    generation = int(await pipe.incr(f"{self.state.k}:group_generation"))
                    group = SyncGroup(
                        name=f"sluice-sync-{run_id}-{generation}",
                        generation=generation,
                        master_address=req.master_address,
                        master_port=req.master_port,
                        world_size=world_size,
                        backend=req.backend,
                        members=members,
                    )
                    pipe.multi()
                    pipe.set(current_key, json.dumps({"key": key, "group": group.model_dump()}))
                    pipe.publish(self.state.events_channel, "groups")
                    await pipe.execute()
                    return group
                except aioredis.WatchError:
                    continue

    async def current_group(self, run_id: str) -> SyncGroup:
        text = await self.state.redis.get(f"{self.state.run_key(run_id)}:group")
        if text is None:
            raise Missing(f"run {run_id} has no sync group yet")
        return SyncGroup(**json.loads(text)["group"])

    async def report_sync(self, run_id: str, report: SyncReport) -> None:
        """Keep the report (the newest 1000) and, for an ok one, record `report.version` as the version each
        engine it names holds (K:held): the publisher heard each load it. One script."""
        engines = report.engines if report.ok else []
        await self._report_sync(
            keys=[f"{self.state.run_key(run_id)}:syncs", f"{self.state.k}:nodes", f"{self.state.k}:held"],
            args=[report.model_dump_json(), report.version, run_id, *engines],
        )

    async def sync_reports(self, run_id: str, limit: int) -> list[SyncReport]:
        texts = await self.state.redis.lrange(f"{self.state.run_key(run_id)}:syncs", 0, limit - 1)
        return [SyncReport.model_validate_json(t) for t in texts]
