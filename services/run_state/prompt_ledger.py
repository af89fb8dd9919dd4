"""Which prompt groups the rollout has written, so a restarted rollout neither skips nor repeats a
prompt: positions below `frontier` are all written; positions at or above it are written iff they
are in the `written` set (groups complete out of order). A group is marked after its rows are in
TransferQueue; the rollout also re-reads open partitions on start (see RolloutService.recover) to
cover a crash between the two."""

from __future__ import annotations

import redis.asyncio as aioredis

from services.run_state import run_key

# Mark a position written and advance the frontier over the contiguous written prefix, atomically.
_MARK = """
local frontier = tonumber(redis.call('GET', KEYS[1]) or '0')
local pos = tonumber(ARGV[1])
if pos < frontier or redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {frontier, 0} end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
while redis.call('SISMEMBER', KEYS[2], tostring(frontier)) == 1 do
  redis.call('SREM', KEYS[2], tostring(frontier))
  frontier = frontier + 1
end
redis.call('SET', KEYS[1], frontier)
return {frontier, redis.call('SCARD', KEYS[3])}
"""


class PromptLedger:
    def __init__(self, redis: aioredis.Redis, run_id: str):
        self.redis = redis
        self.run_id = run_id
        self._frontier = run_key(run_id, "rollout", "frontier")
        self._written = run_key(run_id, "rollout", "written")
        self._mark = redis.register_script(_MARK)

    def _step_key(self, step: int) -> str:
        return run_key(self.run_id, "rollout", "step", str(step))

    async def load(self) -> tuple[int, set[int]]:
        frontier = int(await self.redis.get(self._frontier) or 0)
        return frontier, {int(p) for p in await self.redis.smembers(self._written)}

    async def mark_written(self, position: int, step: int) -> int:
        """Record a written group; returns how many groups of `step` are written (a repeat is not counted)."""
        _, in_step = await self._mark(keys=[self._frontier, self._written, self._step_key(step)], args=[position])
        return int(in_step) if in_step else await self.groups_written(step)

    async def groups_written(self, step: int) -> int:
        return int(await self.redis.scard(self._step_key(step)))
