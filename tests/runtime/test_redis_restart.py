"""Redis killed with kill -9 and restarted (AOF on, as the shipped deployments run it): the coordinator
and the TransferQueue controller keep running, answer 503 / UNAVAILABLE while it is down (never a
crash), and serve everything they had once it is back, without being restarted themselves."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.run_contract.run_config import RunConfig
from services.runtime.processes import free_port, start_redis
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.errors import TQError
from services.transferqueue.local_stack import LocalTransferQueue

pytestmark = pytest.mark.slow


def _eventually(call, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except Exception:  # noqa: BLE001 - whatever a service says while Redis comes back
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_services_reconnect_after_redis_restarts(tmp_path):
    port, data = free_port(), str(tmp_path / "redis")
    redis, url = start_redis(port, log_dir=str(tmp_path), data_dir=data)
    try:
        with (
            LocalTransferQueue(shards=1, redis_url=url, log_dir=str(tmp_path)) as stack,
            LocalDCS(redis_url=url.replace("/0", "/1"), log_dir=str(tmp_path)) as dcs,
            TransferQueue(stack.controller_address) as tq,
            DCSClient(dcs.url) as coordinator,
        ):
            tq.create_partition("p")
            tq.register_task("t", ["x"])
            tq.put("p", {"x": torch.arange(4)})
            coordinator.create_run(RunConfig(name="r", model="/m"))
            coordinator.pause("r")

            redis.kill()
            with pytest.raises(TQError) as err:
                tq.list_partitions()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(Exception) as down:
                coordinator.run("r")
            assert "503" in str(down.value)

            redis, _ = start_redis(port, log_dir=str(tmp_path), data_dir=data)
            batch = _eventually(lambda: tq.claim("p", "t", 4))
            assert batch.rows == [0, 1, 2, 3] and torch.equal(batch["x"], torch.arange(4))
            assert _eventually(lambda: coordinator.run("r")).desired_state == "paused"
            assert stack.controller.alive() and dcs.proc.alive()  # reconnected, not restarted
    finally:
        redis.stop()
