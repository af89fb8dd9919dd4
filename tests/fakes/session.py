"""A role's run session (services/role/session.py: RunSession) over the in-memory fakes: what a role's unit test
hands its loop instead of the session the host opens. The run's data plane is one InMemoryDataPlane (`tq`, and
`atq` over it for the rollout); the trainer's progress is read from `redis` (an InMemoryRedis, as the trainer
writes it) when one is given, else from the `progress` box the test moves; every membership the role makes is
kept in `memberships`."""

from __future__ import annotations

from typing import Callable

from services.run_contract.run_config import RunConfig
from services.run_state.step_partitions import StepPartitions
from services.run_state.trainer_progress import TrainerProgress, read_progress
from tests.fakes.data_plane import AsyncInMemoryDataPlane, InMemoryDataPlane
from tests.fakes.run_state import FakeMembership, InMemoryLedger, ProgressBox


class FakeRunSession:
    def __init__(
        self,
        run: RunConfig,
        plane: InMemoryDataPlane | None = None,
        *,
        coordinator=None,
        redis=None,
        progress: ProgressBox | None = None,
        ledger: InMemoryLedger | None = None,
        evaluations=None,
        source_rewards=None,
        run_id: str = "default",
        poll_s: float = 0.0,
        membership: Callable[..., object] = FakeMembership,
    ):
        self.run, self.run_id = run, run_id
        self.plane = plane if plane is not None else InMemoryDataPlane()
        self.tq, self.atq = self.plane, AsyncInMemoryDataPlane(self.plane)
        self.dcs = coordinator  # an InMemoryCoordinator where the role talks to the coordinator
        self.redis = redis
        self.progress_box = progress if progress is not None else ProgressBox()
        self.ledger = ledger if ledger is not None else InMemoryLedger()
        self.evaluations, self.source_rewards = evaluations, source_rewards
        self.steps = StepPartitions(self.plane, self.trainer_progress, run, poll_s=poll_s)
        self.make_membership = membership
        self.memberships: list = []

    def trainer_progress(self) -> TrainerProgress:
        return read_progress(self.redis, self.run_id) if self.redis is not None else self.progress_box.read()

    async def progress(self) -> TrainerProgress:
        return self.trainer_progress()

    def join(self, registration):
        self.memberships.append(self.make_membership(self.dcs, registration))
        return self.memberships[-1]

    @property
    def membership(self):
        """The role's own membership (the rollout's first; the engines' it keeps registered follow)."""
        return self.memberships[0]
