"""Groups that finish while a put is in flight share the next put; every caller learns its own outcome."""

import asyncio

import pytest
import torch

from services.rollout.put_coalescing import PutCoalescer, merge_columns


def group(position: int, n: int = 2) -> dict:
    return {"prompt_position": torch.full((n,), position), "tokens": [torch.arange(position + k + 1) for k in range(n)]}


class SlowPlane:
    def __init__(self, fail_on: int | None = None):
        self.puts: list[tuple[str, dict]] = []
        self.fail_on = fail_on
        self.release = asyncio.Event()

    async def put(self, partition: str, columns: dict):
        self.puts.append((partition, columns))
        await self.release.wait()
        if self.fail_on is not None and self.fail_on in columns["prompt_position"].tolist():
            raise RuntimeError("shard gone")


def test_groups_finishing_during_a_put_share_the_next_one():
    async def scenario():
        plane = SlowPlane()
        writes = PutCoalescer(plane.put)
        first = asyncio.ensure_future(writes.put("r/train_0", group(0)))
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(writes.put("r/train_0", group(p))) for p in (1, 2, 3)]
        other = asyncio.ensure_future(writes.put("r/train_1", group(9)))  # another partition: its own put
        await asyncio.sleep(0.01)
        assert [p for p, _ in plane.puts] == ["r/train_0", "r/train_1"] and not first.done()
        plane.release.set()
        await asyncio.gather(first, *later, other)
        return plane, writes

    plane, writes = asyncio.run(scenario())
    assert writes.puts == 3 and not writes.partitions
    merged = plane.puts[2][1]
    assert plane.puts[2][0] == "r/train_0" and merged["prompt_position"].tolist() == [1, 1, 2, 2, 3, 3]
    assert [len(t) for t in merged["tokens"]] == [2, 3, 3, 4, 4, 5]


def test_a_failed_put_fails_each_of_its_groups_and_not_the_others():
    async def scenario():
        plane = SlowPlane(fail_on=2)
        writes = PutCoalescer(plane.put)
        first = asyncio.ensure_future(writes.put("r/train_0", group(0)))
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(writes.put("r/train_0", group(p))) for p in (1, 2)]
        await asyncio.sleep(0)
        plane.release.set()
        return await asyncio.gather(first, *later, return_exceptions=True)

    first, one, two = asyncio.run(scenario())
    assert first is None and isinstance(one, RuntimeError) and isinstance(two, RuntimeError)


def test_merging_needs_the_same_fields():
    with pytest.raises(ValueError, match="same fields"):
        merge_columns([group(0), {"prompt_position": torch.zeros(2)}])
    one = group(4)
    assert merge_columns([one]) is one
