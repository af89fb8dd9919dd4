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


class InstantPlane:
    def __init__(self):
        self.puts: list[tuple[str, dict]] = []

    async def put(self, partition: str, columns: dict):
        self.puts.append((partition, columns))


def expecting(groups: int, linger_s: float) -> tuple[InstantPlane, PutCoalescer]:
    """A coalescer over an instant plane, told that `groups` groups of r/train_0 are generating."""
    plane = InstantPlane()
    writes = PutCoalescer(plane.put, linger_s=linger_s)
    for _ in range(groups):
        writes.expect("r/train_0")
    return plane, writes


def test_a_burst_of_expected_groups_goes_out_as_one_put():
    async def scenario():
        plane, writes = expecting(3, linger_s=5.0)
        first = asyncio.ensure_future(writes.put("r/train_0", group(0)))
        await asyncio.sleep(0.02)
        assert plane.puts == [] and not first.done()  # held for its two siblings
        second = asyncio.ensure_future(writes.put("r/train_0", group(1)))
        await asyncio.sleep(0.02)
        assert plane.puts == []
        await writes.put("r/train_0", group(2))
        await asyncio.gather(first, second)
        return plane, writes

    plane, writes = asyncio.run(scenario())
    assert writes.puts == 1 and not writes.partitions
    assert plane.puts[0][1]["prompt_position"].tolist() == [0, 0, 1, 1, 2, 2]


def test_an_abandoned_sibling_releases_the_put_and_a_straggler_waits_at_most_the_linger():
    async def scenario():
        plane, writes = expecting(3, linger_s=0.2)
        loop = asyncio.get_running_loop()
        started = loop.time()  # before the put: its linger deadline starts after this
        first = asyncio.ensure_future(writes.put("r/train_0", group(0)))
        await asyncio.sleep(0.01)
        writes.abandon("r/train_0")  # one sibling failed; the third is a straggler
        await first
        held = loop.time() - started
        assert [c["prompt_position"].tolist() for _, c in plane.puts] == [[0, 0]]
        assert "r/train_0" in writes.partitions  # the straggler is still counted
        await writes.put("r/train_0", group(2))  # the straggler arrives: its own put, without a wait
        return plane, writes, held

    plane, writes, held = asyncio.run(scenario())
    assert 0.19 < held < 5  # the 0.2 s linger, not forever
    assert writes.puts == 2 and not writes.partitions


def test_abandoning_the_last_expected_group_leaves_nothing_behind():
    async def scenario():
        writes = PutCoalescer(InstantPlane().put, linger_s=1.0)
        writes.expect("r/train_3")
        writes.abandon("r/train_3")
        return writes

    assert not asyncio.run(scenario()).partitions
