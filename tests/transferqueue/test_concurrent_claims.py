"""The controller under many readers at once, as real processes: 400 claims long-polling one partition
together each get their own row once the rows arrive: none refused, none timed out, no row twice."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.transferqueue.client.queue import AsyncTransferQueue

pytestmark = pytest.mark.slow

CLAIMS = 400


def test_four_hundred_waiting_claims_each_get_one_row(tq_stack, uniq):
    partition, task = uniq("p"), uniq("t")

    async def main():
        async with AsyncTransferQueue(tq_stack.controller_address) as tq:
            await tq.create_partition(partition)
            await tq.register_task(task, ["x"])
            claims = [
                asyncio.create_task(tq.claim_rows(partition, task, 1, wait_s=60, lease_s=120)) for _ in range(CLAIMS)
            ]
            await asyncio.sleep(2.0)  # every claim is waiting
            assert not any(c.done() for c in claims)
            await tq.put(partition, {"x": torch.arange(CLAIMS)})
            return await asyncio.wait_for(asyncio.gather(*claims), 60)

    claimed = asyncio.run(main())
    rows = [row for c in claimed for row in c.rows]
    assert sorted(rows) == sorted(set(rows)) and len(rows) == CLAIMS
