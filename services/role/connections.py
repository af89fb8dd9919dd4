"""What a (thread-based) role connects to before its loop starts: the coordinator (and through it the
run's config), TransferQueue, Redis run state, and the step walker over train_<N>."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import redis

from services.dcs.client import DCSClient
from services.run_contract.run_config import RunConfig
from services.role.run_config_wait import wait_for_run
from services.run_state.step_partitions import StepPartitions
from services.run_state.trainer_progress import read_progress
from services.run_state.seams import DataPlane
from services.runtime.redis_clients import sync_redis
from services.role.role_service import RoleSettings
from services.transferqueue.client.queue import TransferQueue


@dataclass
class RunConnections:
    dcs: DCSClient
    run: RunConfig
    tq: DataPlane
    redis: redis.Redis
    steps: StepPartitions

    @classmethod
    def open(cls, config: RoleSettings, halt: threading.Event) -> "RunConnections | None":
        """None if halted before the run was created."""
        token = config.auth_token or None
        dcs = DCSClient(config.dcs_url, token=token)
        run = wait_for_run(dcs, config.run_id, halt)
        if run is None:
            dcs.close()
            return None
        tq = TransferQueue(config.tq_controller, token=token)
        client = sync_redis(config.redis_url)
        return cls(dcs, run, tq, client, StepPartitions(tq, lambda: read_progress(client, config.run_id), run))

    def close(self) -> None:
        for part in (self.tq, self.redis, self.dcs):
            if part is not None:  # a role's unit test gives only what the role uses
                part.close()
