"""Controller crash/restart (item 10), auth (item 13), back-pressure and service hygiene."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from services.runtime.processes import free_port
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.client.shard_client import ShardClient
from services.transferqueue.errors import TQError
from services.transferqueue.local_stack import LocalTransferQueue, grpc_serving
from tests.conftest import scrape


@pytest.fixture
def private_stack(tmp_path):
    stacks = []

    def make(**kwargs):
        stack = LocalTransferQueue(log_dir=str(tmp_path), **kwargs)
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        s.stop()


def test_controller_killed_and_restarted_loses_nothing(private_stack):
    stack = private_stack(shards=1)
    with TransferQueue(stack.controller_address) as tq:
        tq.create_partition("p", group_size=2)
        tq.register_task("t", ["x"], group_size=2)
        tq.put("p", {"x": torch.arange(8)})
        held = tq.claim("p", "t", 4, lease_s=60)
        short = tq.claim("p", "t", 2, lease_s=10.0)  # outlives a slow restart
        result = {}

        def waiter():  # a claim waiting across the crash, retried by the client after it
            with TransferQueue(stack.controller_address) as client:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        result["batch"] = client.claim("q", "t", 2, wait_s=10)
                        return
                    except TQError as err:
                        result.setdefault("errors", []).append(err.code)
                        time.sleep(0.2)

        tq.create_partition("q", group_size=2)
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)
        stack.controller.kill()  # SIGKILL: no chance to clean up
        stack.start_controller()
        # readiness carried on: the remaining group is still claimable, the held lease still acks
        assert tq.claim("p", "t", 2).rows == [6, 7]
        assert tq.ack(held) == 4
        # a lease that expired while the controller was down comes back to readers
        assert tq.claim("p", "t", 2, wait_s=30).rows == short.rows
        tq.put("q", {"x": torch.arange(2)})
        thread.join(30)
        assert result["batch"].rows == [0, 1]
        info = tq.partition("p")
        assert [(t.ready, t.consumed) for t in info.tasks] == [(8, 4)]


def test_auth_token_required_everywhere(private_stack):
    stack = private_stack(shards=1, token="s3cret")
    with TransferQueue(stack.controller_address) as anon:
        with pytest.raises(TQError) as err:
            anon.list_partitions()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with TransferQueue(stack.controller_address, token="wrong") as wrong:
        with pytest.raises(TQError) as err:
            wrong.create_partition("p")
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    for method in ("stats", "drop_partition"):
        with pytest.raises(TQError) as err:
            getattr(ShardClient(stack.shard_addresses[0]), method)(*(["p"] if method == "drop_partition" else []))
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(TQError) as err:
        ShardClient(stack.shard_addresses[0]).put("p", [0], b"x")
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with TransferQueue(stack.controller_address, token="s3cret") as tq:
        tq.create_partition("p")
        tq.register_task("t", ["x"])
        rows = tq.put("p", {"x": torch.arange(3)})
        assert tq.get("p", rows, ["x"])["x"].tolist() == [0, 1, 2]
    assert grpc_serving(stack.controller_address)  # health stays open for probes


def test_full_shard_pushes_back_and_never_evicts(private_stack):
    stack = private_stack(shards=1, shard_args=("--max-rows", "8"))
    with TransferQueue(stack.controller_address, put_timeout_s=0.5) as tq:
        tq.create_partition("p")
        tq.register_task("t", ["x"])
        tq.put("p", {"x": torch.arange(8)})
        with pytest.raises(TQError) as err:
            tq.put("p", {"x": torch.arange(4)})  # retried with backoff, then given up
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert tq.partition("p").rows == 8
        assert tq.get("p", list(range(8)), ["x"])["x"].tolist() == list(range(8))  # nothing evicted
    with TransferQueue(stack.controller_address, put_timeout_s=30) as tq:
        result = {}
        thread = threading.Thread(target=lambda: result.update(rows=tq.put("p2", {"x": torch.arange(4)})))
        tq.create_partition("p2")
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive()  # backing off while the shard is full
        tq.clear_partition("p")  # frees the shard
        thread.join(30)
        assert result["rows"] == [0, 1, 2, 3]


def test_services_shut_down_cleanly_on_sigterm(private_stack):
    metrics_port = free_port()
    stack = private_stack(shards=1, controller_args=("--metrics-port", str(metrics_port)))
    text = scrape(metrics_port)
    assert "sluice_tq_rpc_total" in text
    assert stack.shards[0].stop() == 0
    assert stack.controller.stop() == 0
    log = stack.controller.log_tail()
    assert '"msg": "controller stopped"' in log
    assert '"service": "tq-controller"' in log  # structured logs
    assert '"msg": "shard stopped"' in stack.shards[0].log_tail()
