"""A role's session with its run: what the host (serve_role, role_service.py) opens once the run exists and the
role's preflight passed, hands to the role's loop, and closes when the loop returns. A role builds none of it.

    run            the run's config, as the host read it while waiting for the run
    dcs            the coordinator's client, the one the host watches the run's lifecycle with
    join(node)     the role's membership in the run (pause at safe points, report progress)
    tq, steps      the data plane and the step walker over <run>/train_<N> (thread-based roles)
    redis          the run's records in Redis (the trainer's progress record, its step records)
    atq, ledger, progress, evaluations, source_rewards      the rollout's asyncio clients and records

A client is made the first time the role asks for it: a thread-based role never opens the asyncio ones, the
rollout never the blocking ones. A role's unit test passes tests/fakes/session.py's FakeRunSession instead."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Protocol, TypeVar

import redis
import redis.asyncio as aioredis

from services.dcs.client import DCSClient
from services.dcs.membership import RunMembership
from services.dcs.models import NodeRegistration
from services.run_contract.run_config import RunConfig
from services.run_state.evaluations import EvaluationStore
from services.run_state.prompt_ledger import PromptLedger
from services.run_state.seams import AsyncDataPlane, DataPlane, Evaluations, Ledger, Membership
from services.run_state.source_rewards import SourceRewards
from services.run_state.step_partitions import StepPartitions
from services.run_state.trainer_progress import TrainerProgress, aread_progress, read_progress
from services.runtime.redis_clients import async_redis, sync_redis
from services.transferqueue.client.queue import AsyncTransferQueue, TransferQueue

log = logging.getLogger(__name__)
Made = TypeVar("Made")


class RunSession(Protocol):
    """What a role's loop is given (above); LiveRunSession is the real one."""

    run: RunConfig
    dcs: DCSClient

    def join(self, registration: NodeRegistration) -> Membership: ...

    @property
    def tq(self) -> DataPlane: ...

    @property
    def steps(self) -> StepPartitions: ...

    @property
    def redis(self) -> redis.Redis: ...

    @property
    def atq(self) -> AsyncDataPlane: ...

    @property
    def ledger(self) -> Ledger: ...

    async def progress(self) -> TrainerProgress: ...

    @property
    def evaluations(self) -> Evaluations | None: ...

    @property
    def source_rewards(self) -> SourceRewards | None: ...


class LiveRunSession:
    """The session against the run's real services, from the role's connection settings (RoleSettings)."""

    def __init__(self, settings: Any, run: RunConfig, dcs: DCSClient):
        self.settings, self.run, self.dcs = settings, run, dcs
        self.run_id: str = settings.run_id
        self.token: str | None = settings.auth_token or None
        self._made: dict[str, Any] = {}
        self._lock = threading.RLock()  # a trainer's worker threads may ask for a client first; steps makes tq

    def _once(self, name: str, make: Callable[[], Made]) -> Made:
        with self._lock:
            if name not in self._made:
                self._made[name] = make()
            return self._made[name]

    def join(self, registration: NodeRegistration) -> Membership:
        return RunMembership(self.dcs, registration)

    @property
    def tq(self) -> TransferQueue:
        return self._once("tq", lambda: TransferQueue(self.settings.tq_controller, token=self.token))

    @property
    def redis(self) -> redis.Redis:
        return self._once("redis", lambda: sync_redis(self.settings.redis_url))

    @property
    def steps(self) -> StepPartitions:
        return self._once(
            "steps", lambda: StepPartitions(self.tq, lambda: read_progress(self.redis, self.run_id), self.run)
        )

    @property
    def atq(self) -> AsyncTransferQueue:
        return self._once("atq", lambda: AsyncTransferQueue(self.settings.tq_controller, token=self.token))

    @property
    def aredis(self) -> aioredis.Redis:
        return self._once("aredis", lambda: async_redis(self.settings.redis_url))

    @property
    def ledger(self) -> PromptLedger:
        return self._once("ledger", lambda: PromptLedger(self.aredis, self.run_id))

    async def progress(self) -> TrainerProgress:
        return await aread_progress(self.aredis, self.run_id)

    @property
    def evaluations(self) -> EvaluationStore:
        return self._once("evaluations", lambda: EvaluationStore(self.aredis, self.run_id))

    @property
    def source_rewards(self) -> SourceRewards:
        return self._once("source_rewards", lambda: SourceRewards(self.aredis, self.run_id))

    async def aclose(self) -> None:
        """Close the clients the role opened (the coordinator's is the host's); a failure is logged, not raised:
        the loop's own outcome is what the host reports."""
        made, self._made = self._made, {}
        closers = [
            ("tq", lambda c: asyncio.to_thread(c.close)),
            ("redis", lambda c: asyncio.to_thread(c.close)),
            ("atq", lambda c: c.close()),
            ("aredis", lambda c: c.aclose()),
        ]
        for name, close in closers:
            if name in made:
                try:
                    await close(made[name])
                except Exception as exc:
                    log.warning("closing the run session failed", extra={"client": name, "error": str(exc)})
