"""Which prompt groups the rollout has written, so a restarted rollout neither skips nor repeats a
prompt: positions below `frontier` are all written; positions at or above it are written iff they
are in the `written` set (groups complete out of order). A group is marked after its rows are in
TransferQueue; the rollout also re-reads open partitions on start (see RolloutService.recover) to
cover a crash between the two.

A ledger position is a group *slot*: slot g belongs to step g // rollout_batch_size and normally holds the
prompt at position g. When the run's reward fails on a group and `rollout.reward_fallback` is `skip_group`,
the group is dropped and its slot gets a spare prompt instead, so the step still gets its rows:

    spare prompt positions    first_spare, first_spare + 1, ...  (first_spare = every slot of the run)
    rollout:replacements      hash slot -> the prompt position the slot holds now
    rollout:skipped           hash prompt position -> why its group was dropped
    rollout:filtered          hash step -> groups of the step dropped by dynamic sampling (rollout.filter_groups)

So every prompt position below first_spare + len(skipped) is either trained exactly once or skipped,
never both (tests/e2e/run_checks.py checks it).

A written group's TransferQueue rows are kept per step (`rollout:rows:<step>`, slot -> rows), so that when
rows are lost with their shard before the trainer consumed them the rollout knows which slots to generate
again: `unwrite` takes such a slot out of its step's set (the step is sealed again once it is rewritten)."""

from __future__ import annotations

from typing import Iterable, Sequence, cast

import redis
import redis.asyncio as aioredis

from services.run_state import run_key

# Mark a position written and advance the frontier over the contiguous written prefix, atomically.
_MARK = """
local frontier = tonumber(redis.call('GET', KEYS[1]) or '0')
local pos = tonumber(ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[4], ARGV[1], ARGV[2]) end
-- a slot written again (its rows were lost) is below the frontier: it only rejoins its step
if pos < frontier or redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  redis.call('SADD', KEYS[3], ARGV[1])
  return {frontier, redis.call('SCARD', KEYS[3])}
end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
while redis.call('SISMEMBER', KEYS[2], tostring(frontier)) == 1 do
  redis.call('SREM', KEYS[2], tostring(frontier))
  frontier = frontier + 1
end
redis.call('SET', KEYS[1], frontier)
return {frontier, redis.call('SCARD', KEYS[3])}
"""

# Drop the group of `slot` (prompt ARGV[2]) and give the slot the next spare prompt, atomically; a repeat (the
# slot already moved on from that prompt) returns the slot's current prompt and allocates nothing. A group
# dropped by dynamic sampling (ARGV[5] = its step) is counted for its step.
_SKIP = """
local current = redis.call('HGET', KEYS[1], ARGV[1]) or ARGV[1]
if current ~= ARGV[2] then return tonumber(current) end
local spare = tonumber(ARGV[4]) + redis.call('INCR', KEYS[3]) - 1
redis.call('HSET', KEYS[1], ARGV[1], spare)
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[5], 1) end
return spare
"""


class PromptLedger:
    def __init__(self, redis: aioredis.Redis, run_id: str):
        self.redis = redis
        self.run_id = run_id
        self._frontier = run_key(run_id, "rollout", "frontier")
        self._written = run_key(run_id, "rollout", "written")
        self._mark = redis.register_script(_MARK)
        self._replacements = run_key(run_id, "rollout", "replacements")
        self._skipped = run_key(run_id, "rollout", "skipped")
        self._spares = run_key(run_id, "rollout", "spares")
        self._filtered = run_key(run_id, "rollout", "filtered")
        self._skip = redis.register_script(_SKIP)

    def _step_key(self, step: int) -> str:
        return run_key(self.run_id, "rollout", "step", str(step))

    async def load(self) -> tuple[int, set[int]]:
        frontier = int(await self.redis.get(self._frontier) or 0)
        return frontier, {int(p) for p in await self.redis.smembers(self._written)}

    def _rows_key(self, step: int) -> str:
        return run_key(self.run_id, "rollout", "rows", str(step))

    async def mark_written(self, position: int, step: int, rows: Sequence[int] = ()) -> int:
        """Record a written group (and its TransferQueue rows); returns how many groups of `step` are
        written (a repeat is not counted twice)."""
        _, in_step = await self._mark(
            keys=[self._frontier, self._written, self._step_key(step), self._rows_key(step)],
            args=[position, ",".join(str(int(r)) for r in rows)],
        )
        return int(in_step)

    async def slots_with_rows(self, step: int, rows: Iterable[int]) -> set[int]:
        """The written slots of `step` any of whose rows are among `rows`."""
        wanted = set(rows)
        held = cast(dict[str, str], await self.redis.hgetall(self._rows_key(step)))  # a decode_responses client
        return {int(slot) for slot, csv in held.items() if wanted.intersection(int(r) for r in csv.split(",") if r)}

    async def unwrite(self, slot: int, step: int) -> None:
        """The slot's rows were lost before the trainer consumed them: it is to be generated again."""
        await self.redis.srem(self._step_key(step), slot)

    async def groups_written(self, step: int) -> int:
        return int(await self.redis.scard(self._step_key(step)))

    async def replacements(self) -> dict[int, int]:
        """slot -> the prompt position it holds, for the slots whose prompt was replaced."""
        return {int(k): int(v) for k, v in (await self.redis.hgetall(self._replacements)).items()}

    async def skip(
        self, slot: int, position: int, reason: str, first_spare: int, filtered_step: int | None = None
    ) -> int:
        """Drop the group of `slot` (prompt `position`, dropped because of `reason`) and return the spare
        prompt position the slot holds from now on; `filtered_step`: dynamic sampling dropped it, count it there."""
        return int(
            await self._skip(
                keys=[self._replacements, self._skipped, self._spares, self._filtered],
                args=[slot, position, reason[:500], first_spare, "" if filtered_step is None else filtered_step],
            )
        )

    async def filtered(self, step: int) -> int:
        """Groups of `step` dynamic sampling dropped so far."""
        return int(await self.redis.hget(self._filtered, str(step)) or 0)


def skipped_prompts(client: redis.Redis, run_id: str) -> dict[int, str]:
    """prompt position -> why its group was dropped (`rollout.reward_fallback: skip_group`), for any process."""
    skipped = cast(dict[str, str], client.hgetall(run_key(run_id, "rollout", "skipped")))  # decode_responses
    return {int(k): v for k, v in skipped.items()}


def filtered_groups(client: redis.Redis, run_id: str, step: int) -> int:
    """Groups of `step` dropped by dynamic sampling (rollout.filter_groups), for any process."""
    return int(client.hget(run_key(run_id, "rollout", "filtered"), str(step)) or 0)


def resume_ledger_at(client: redis.Redis, run_id: str, first_slot: int) -> None:
    """A run resumed from a checkpoint on a new Redis (`sluice run --resume` with a private one): the slots of
    the steps the checkpoint covers count as written, so the rollout starts at the checkpoint's step. Does
    nothing to a ledger that exists."""
    client.set(run_key(run_id, "rollout", "frontier"), first_slot, nx=True)
