"""A shard killed with kill -9 (real redis-server, controller and shard processes): restarted on its
--data-dir it holds every row it acknowledged, a read waiting across the kill gets its rows once the
shard is back, and a read of a shard that stays down fails within the client's shard wait, not the
two-minute RPC deadline; a put across the kill lands, and one to a shard that stays down fails within
the put's timeout."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.client.shard_client import ShardClient
from services.transferqueue.errors import TQError
from services.transferqueue.local_stack import LocalTransferQueue

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(tmp_path):
    with LocalTransferQueue(shards=1, log_dir=str(tmp_path), data_dir=str(tmp_path / "data")) as s:
        yield s


def test_a_killed_shard_restarts_with_every_acknowledged_row(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2)
        tq.register_task("t", ["x", "y"], group_size=2)
        rows = tq.put("p", {"x": torch.arange(8).view(4, 2)})
        tq.put("p", {"y": torch.arange(4, dtype=torch.float32)}, rows=rows)
        tq.put("p", {"x": torch.arange(4).view(2, 2) + 100})  # rows 4, 5: x only, not claimable yet
        tq.create_partition("gone")
        tq.put("gone", {"x": torch.zeros(2, 1)})
        assert tq.clear_partition("gone")
        first = tq.claim("p", "t", 2)
        tq.ack(first)

        stack.shards[0].kill()
        stack.restart_shard(0)

        info = tq.partition("p")
        assert info.lost_rows == 0  # the same incarnation: nothing was marked lost
        rest = tq.claim("p", "t", 2, fields=["x", "y"])
        assert rest.rows == [2, 3]
        assert torch.equal(rest["x"], torch.tensor([[4, 5], [6, 7]]))
        assert torch.equal(rest["y"], torch.tensor([2.0, 3.0]))
        assert torch.equal(tq.get("p", [4, 5], ["x"])["x"], torch.tensor([[100, 101], [102, 103]]))
        shard = ShardClient(stack.shard_addresses[0])
        try:
            assert list(shard.stats().partitions) == ["p"]  # the cleared partition stayed cleared
        finally:
            shard.close()


def test_a_read_waiting_across_the_kill_gets_its_rows(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p")
        tq.register_task("t", ["x"])
        tq.put("p", {"x": torch.arange(6)})
        stack.shards[0].kill()
        got = {}

        def read():
            started = time.monotonic()
            got["batch"] = tq.claim("p", "t", 6)
            got["seconds"] = time.monotonic() - started

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)
        stack.restart_shard(0)
        reader.join(60)
        assert got["batch"].rows == list(range(6))
        assert torch.equal(got["batch"]["x"], torch.arange(6))


def test_a_read_of_a_shard_that_stays_down_fails_within_the_shard_wait(tmp_path):
    with LocalTransferQueue(shards=1, log_dir=str(tmp_path)) as stack:
        with TransferQueue(stack.controller_address, shard_wait_s=3.0) as tq:
            tq.create_partition("p")
            tq.register_task("t", ["x"])
            tq.put("p", {"x": torch.arange(4)})
            stack.shards[0].kill()
            started = time.monotonic()
            with pytest.raises(TQError) as err:
                tq.claim("p", "t", 4)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "shard-0" in err.value.message
            assert time.monotonic() - started < 15
            # the claim was released: the rows go to the next reader once the shard is back
            info = tq.partition("p")
            assert [(t.ready, t.consumed) for t in info.tasks] == [(4, 0)]


def test_a_put_across_the_kill_lands_once_the_shard_is_back(stack):
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p")
        tq.register_task("t", ["x"])
        tq.put("p", {"x": torch.arange(2)})  # the client knows the shard
        stack.shards[0].kill()
        restarter = threading.Timer(1.0, stack.restart_shard, args=(0,))
        restarter.start()
        try:
            rows = tq.put("p", {"x": torch.arange(4) + 10})  # sent while the shard is down
        finally:
            restarter.join()
        assert rows == [2, 3, 4, 5]
        assert torch.equal(tq.claim("p", "t", 6)["x"], torch.tensor([0, 1, 10, 11, 12, 13]))


def test_a_put_to_a_shard_that_stays_down_fails_within_its_timeout_and_stores_nothing(tmp_path):
    with LocalTransferQueue(shards=1, log_dir=str(tmp_path)) as stack:
        with TransferQueue(stack.controller_address, put_timeout_s=2.0) as tq:
            tq.create_partition("p")
            tq.register_task("t", ["x"])
            tq.put("p", {"x": torch.arange(2)})
            stack.shards[0].kill()
            started = time.monotonic()
            with pytest.raises(TQError) as err:
                tq.put("p", {"x": torch.arange(4)})
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "shard-0" in err.value.message
            assert time.monotonic() - started < 15
            assert tq.partition("p").rows == 2  # the failed put committed nothing
