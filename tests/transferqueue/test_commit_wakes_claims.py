"""A commit wakes the claims long-polling its partition on the same controller at once, without waiting for the
Redis message that wakes the other replicas (a hop later, or never if it is lost)."""

from __future__ import annotations

import asyncio

from services.transferqueue.controller import server as controller_server
from services.transferqueue.controller.config import ControllerConfig
from services.transferqueue.controller.metadata import ClaimResult
from services.transferqueue.controller.server import ControllerServicer
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.runtime.redis_events import RedisEvents


class Rows:
    """The controller's metadata for one partition: rows become claimable when committed."""

    def __init__(self):
        self.committed: list[int] = []

    async def commit_put(self, partition, fields, rows, stored=()):
        self.committed += rows
        return len(rows)

    async def claim(self, partition, task, batch_rows, min_rows, lease_ms, claim_key):
        if len(self.committed) < min_rows:
            return ClaimResult(lease_id="", groups=[], expiry_ms=0, complete=False, group_size=1, ready_groups_left=0)
        return ClaimResult(
            lease_id="l1",
            groups=self.committed[:batch_rows],
            expiry_ms=1,
            complete=False,
            group_size=1,
            ready_groups_left=0,
        )


class Context:
    async def abort(self, code, message):
        raise AssertionError(f"{code}: {message}")


def test_a_commit_answers_a_waiting_claim_without_the_redis_message(monkeypatch):
    monkeypatch.setattr(controller_server, "MAX_SLEEP_S", 3600.0)  # no periodic re-check to fall back on

    async def scenario():
        events = RedisEvents(redis=None, channel="unused")  # never subscribed: no message will come
        servicer = ControllerServicer(ControllerConfig(), Rows(), events)
        claim = asyncio.ensure_future(
            servicer.Claim(
                pb.ClaimRequest(partition="r/train_0", task="t", batch_size=2, min_rows=2, wait_ms=3_600_000), Context()
            )
        )
        await asyncio.sleep(0.05)
        assert not claim.done()  # waiting for rows
        await servicer.CommitPut(
            pb.CommitPutRequest(
                partition="r/train_0", rows=[0, 1], fields=[pb.FieldSchema(name="x", dtype="int64", kind=pb.SCALAR)]
            ),
            Context(),
        )
        return await asyncio.wait_for(claim, 30)

    answer = asyncio.run(scenario())
    assert answer.lease_id == "l1" and list(answer.rows) == [0, 1]
