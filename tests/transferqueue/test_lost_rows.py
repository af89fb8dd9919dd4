"""Rows lost with their shard (real redis-server, controller and shard processes): a shard that comes back
without its data (no --data-dir, so a new incarnation) makes the controller mark the groups it held lost
before it answers the shard's registration. Lost groups are never handed out again, and count as consumed
for every task that had not consumed them. Those rows are listed by LostRows. The partition is unsealed
until its producer writes replacements and seals it again. A group a live lease holds stays in it: acked,
it was consumed (its holder had read it); released or expired, it is lost then. A reader whose claimed rows
were lost gets DATA_LOSS, and a claim-and-read claims again without them."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.transferqueue.client.controller_client import ControllerClient
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.client.shard_client import ShardClient
from services.transferqueue.codec import encode_columns
from services.transferqueue.errors import TQError
from services.transferqueue.local_stack import LocalTransferQueue
from services.transferqueue.wire_format import to_ipc

pytestmark = pytest.mark.slow


def progress(info, task):
    return next(t for t in info.tasks if t.task == task)


def restart_empty(stack, shard_id: str) -> None:
    """kill -9 the shard, and start it again without its data (no --data-dir: a new incarnation)."""
    i = [p.name.split(" ", 1)[1] for p in stack.shards].index(shard_id)
    stack.restart_shard(i)


@pytest.fixture
def stack(tmp_path):
    with LocalTransferQueue(shards=2, log_dir=str(tmp_path)) as s:
        yield s


def test_groups_of_a_shard_that_came_back_empty_are_lost_and_replaced(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2, placement_block=2)  # groups alternate between the shards
        tq.register_task("a", ["x"], group_size=2)
        tq.register_task("b", ["x"], group_size=2)
        assert tq.put("p", {"x": torch.arange(8)}) == list(range(8))
        tq.seal_partition("p")
        on_second = tq.partition("p").shard_ids[1]
        # task a consumed group 1 (on the second shard); task b holds a lease on group 3 (also there)
        a_first = tq.claim("p", "a", 4)  # groups 0 and 1
        tq.ack(a_first)
        first = tq.claim_rows("p", "b", 2, lease_s=60)
        assert first.rows == [0, 1]
        tq.ack(first.lease_id)
        b_lease = tq.claim_rows("p", "b", 6, lease_s=60)
        assert b_lease.rows == [2, 3, 4, 5, 6, 7]

        restart_empty(stack, on_second)

        info = tq.partition("p")
        assert info.lost_rows == 4 and not info.sealed  # groups 1 and 3; a had not consumed 3
        assert progress(info, "a").lost == 2 and tq.lost_rows("p", "a") == [6, 7]
        # b's lease still holds 1 and 3: b may have read them before the loss
        assert progress(info, "b").lost == 0 and tq.lost_rows("p", "b") == []
        assert (progress(info, "b").consumed, progress(info, "b").leased) == (2, 6)
        with pytest.raises(TQError) as lost:
            tq.read_claimed(b_lease, ["x"])
        assert lost.value.code == grpc.StatusCode.DATA_LOSS and "claim again" in lost.value.message
        assert tq.release(b_lease.lease_id) == 2  # group 2 back in the queue; 1 and 3 lost now
        info = tq.partition("p")
        assert progress(info, "b").lost == 4 and tq.lost_rows("p", "b") == [2, 3, 6, 7]
        assert (progress(info, "b").consumed, progress(info, "b").leased) == (6, 0)

        batch = tq.claim("p", "b", 8)  # group 2; 1 and 3 are never handed out again
        assert batch.rows == [4, 5] and torch.equal(batch["x"], torch.tensor([4, 5]))
        tq.ack(batch)
        assert not tq.claim("p", "b", 8, wait_s=0.2).complete  # unsealed: the replacements are due

        assert tq.put("p", {"x": torch.tensor([20, 30, 60, 70])}) == [8, 9, 10, 11]
        tq.seal_partition("p")
        replaced = tq.claim("p", "b", 8)
        assert replaced.rows == [8, 9, 10, 11]
        tq.ack(replaced)
        assert tq.claim("p", "b", 8).complete
        rest = tq.claim("p", "a", 8)
        assert rest.rows == [4, 5, 8, 9, 10, 11]
        tq.ack(rest)
        assert tq.claim("p", "a", 8).complete
        assert tq.partition("p").lost_rows == 4


def test_a_task_registered_after_the_loss_never_sees_the_lost_rows(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2, placement_block=2)
        tq.put("p", {"x": torch.arange(8)})
        tq.seal_partition("p")
        tq.register_task("early", ["x"], group_size=2)
        restart_empty(stack, tq.partition("p").shard_ids[0])
        tq.register_task("late", ["x"], group_size=2)
        batch = tq.claim("p", "late", 8)
        assert batch.rows == [2, 3, 6, 7]
        tq.ack(batch)
        assert tq.partition("p").lost_rows == 4
        assert tq.lost_rows("p", "late") == []  # lost before it existed: nothing it had to consume
        assert tq.lost_rows("p", "early") == [0, 1, 4, 5]


def test_lost_rows_refuses_bad_requests(stack):
    c = ControllerClient(stack.controller_address)
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p")
        tq.register_task("t", ["x"])
        for kwargs, code in (
            ({"task": "nope"}, grpc.StatusCode.NOT_FOUND),
            ({"task": "t", "limit": 70000}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"task": "t", "from_row": -1}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"task": "bad name!"}, grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(TQError) as err:
                c.lost_rows("p", **kwargs)
            assert err.value.code == code
        with pytest.raises(TQError) as err:
            c.lost_rows("missing", "t")
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert list(c.lost_rows("p", "t").rows) == []
    c.close()


def test_a_lease_whose_groups_were_all_lost_is_released_or_acked_as_empty(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2, placement_block=2)
        tq.register_task("t", ["x"], group_size=2)
        tq.put("p", {"x": torch.arange(8)})
        first = tq.claim_rows("p", "t", 2, lease_s=60)
        assert first.rows == [0, 1]
        tq.ack(first.lease_id)
        released, acked = tq.claim_rows("p", "t", 2, lease_s=60), None
        assert released.rows == [2, 3]  # group 1, on the second shard
        restart_empty(stack, tq.partition("p").shard_ids[1])
        assert tq.release(released.lease_id) == 0
        acked = tq.claim_rows("p", "t", 8, lease_s=60)
        assert acked.rows == [4, 5]  # group 3 was lost too
        assert tq.ack(acked.lease_id) == 2
        info = tq.partition("p")
        assert (progress(info, "t").consumed, progress(info, "t").leased) == (8, 0)


def test_a_commit_of_bytes_the_old_incarnation_took_is_refused_and_changes_nothing(stack):
    """The window between a shard storing a put and the put's commit: if the shard came back empty in between,
    the commit names the incarnation that stored the bytes, and the controller refuses it (ABORTED) rather than
    make rows readable whose bytes are gone; the client's put makes the put again."""
    c = ControllerClient(stack.controller_address)
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2)
        tq.register_task("t", ["x"], group_size=2)
        shard_id = tq.partition("p").shard_ids[0]
        _, schemas, batch = encode_columns({"x": torch.arange(2)})
        prepared = c.prepare_put("p", schemas, 2)
        shard = ShardClient(dict((s.shard_id, s.address) for s in c.list_shards().shards)[shard_id])
        reply = shard.put("p", list(prepared.rows), to_ipc(batch), reservation=prepared.reservation)
        shard.close()
        assert reply.incarnation
        restart_empty(stack, shard_id)
        with pytest.raises(TQError) as refused:
            c.commit_put("p", schemas, list(prepared.rows), [(shard_id, reply.incarnation)])
        assert refused.value.code == grpc.StatusCode.ABORTED and "put again" in refused.value.message
        info = tq.partition("p")
        assert info.rows == 0 and info.lost_rows == 0  # nothing became readable
        assert tq.put("p", {"x": torch.arange(2)}) == [2, 3]  # the client's put: the current incarnation
        assert torch.equal(tq.claim("p", "t", 2)["x"], torch.arange(2))
    c.close()


def test_groups_lost_under_a_lease_that_is_acked_were_consumed_and_are_not_replaced(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2, placement_block=2)
        tq.register_task("t", ["x"], group_size=2)
        tq.put("p", {"x": torch.arange(8)})
        tq.seal_partition("p")
        held = tq.claim("p", "t", 8, lease_s=60)  # read before the loss, as a trainer would
        assert held.rows == list(range(8))
        restart_empty(stack, tq.partition("p").shard_ids[1])
        info = tq.partition("p")
        assert info.lost_rows == 4 and info.sealed  # nothing to replace unless the lease is given back
        assert tq.ack(held) == 8
        info = tq.partition("p")
        assert info.sealed and tq.lost_rows("p", "t") == [] and progress(info, "t").lost == 0
        assert (progress(info, "t").consumed, progress(info, "t").leased) == (8, 0)
        assert tq.claim("p", "t", 8).complete


def test_groups_lost_under_a_lease_that_expires_are_lost_then(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2, placement_block=2)
        tq.register_task("t", ["x"], group_size=2)
        tq.put("p", {"x": torch.arange(8)})
        tq.seal_partition("p")
        held = tq.claim_rows("p", "t", 8, lease_s=1.0)
        restart_empty(stack, tq.partition("p").shard_ids[1])
        assert tq.partition("p").sealed
        again = tq.claim("p", "t", 8, wait_s=5.0, lease_s=60)  # after the expiry: groups 0 and 2 come back
        assert again.rows == [0, 1, 4, 5] and held.lease_id != again.lease_id
        info = tq.partition("p")
        assert tq.lost_rows("p", "t") == [2, 3, 6, 7] and not info.sealed  # the replacements are due
        with pytest.raises(TQError) as err:
            tq.ack(held.lease_id)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
