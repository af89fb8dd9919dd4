"""What the rollout connects to before its loop starts, and the seams it is given (services/run_state/seams.py):
the coordinator (and through it the run's config), TransferQueue (asyncio), the run state in Redis (the prompt
ledger, the trainer's progress, the eval results). A role test passes in-memory fakes instead (tests/fakes/)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import redis.asyncio as aioredis

from services.dcs.client import DCSClient
from services.dcs.models import NodeRegistration
from services.rollout.config import RolloutConfig
from services.rollout.engine_pool import EnginePool, Engines
from services.rollout.evaluation import Evaluations
from services.run_contract.run_config import RunConfig
from services.run_state.evaluations import EvaluationStore
from services.run_state.prompt_ledger import PromptLedger
from services.run_state.source_rewards import SourceRewards
from services.role.run_config_wait import wait_for_run
from services.run_state.seams import AsyncDataPlane, Ledger, Membership
from services.run_state.trainer_progress import TrainerProgress, aread_progress
from services.runtime.redis_clients import async_redis
from services.transferqueue.client.queue import AsyncTransferQueue


class RolloutMembership(Membership, Protocol):
    """The rollout's membership (and each engine's it registers): RunMembership, which also says whether
    the run is paused and takes a pause acknowledgement without blocking."""

    suspended: bool

    @property
    def paused(self) -> bool: ...

    def acknowledge_pause(self) -> None: ...


@dataclass
class RolloutConnections:
    dcs: DCSClient                                        # the memberships register through it
    run: RunConfig
    tq: AsyncDataPlane
    ledger: Ledger
    progress: Callable[[], Awaitable[TrainerProgress]]   # the trainer's progress record
    redis: aioredis.Redis | None = None
    evaluations: Evaluations | None = None               # where eval results go (RunConfig.eval)
    source_rewards: SourceRewards | None = None          # reward per data source and step (tracking)

    @classmethod
    async def open(cls, config: RolloutConfig, stop: asyncio.Event) -> "RolloutConnections | None":
        """None if stopped before the run was created."""
        token = config.auth_token or None
        dcs = DCSClient(config.dcs_url, token=token)
        run = await asyncio.to_thread(wait_for_run, dcs, config.run_id, stop)
        if run is None:
            dcs.close()
            return None
        client = async_redis(config.redis_url)
        return cls(dcs, run, AsyncTransferQueue(config.tq_controller, token=token), PromptLedger(client, config.run_id),
                   lambda: aread_progress(client, config.run_id), client, EvaluationStore(client, config.run_id),
                   SourceRewards(client, config.run_id))


def engine_pool(config: RolloutConfig) -> Engines:
    """The engines of `config` (the default of RolloutService's `engines` seam)."""
    return EnginePool(config.engine_urls, timeout_s=config.request_timeout_s,
                      api_key=config.auth_token or None)  # the stack's one token (docs/security.md)


def registration(config: RolloutConfig) -> NodeRegistration:
    """This rollout's node (its engines' registrations are the fleet's: services/rollout/engine_fleet.py)."""
    return NodeRegistration(role="rollout", host=config.advertise_host, ports={"http": config.port},
                            run_id=config.run_id)
