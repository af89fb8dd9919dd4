"""The rollout role against in-memory fakes of its seams (tests/fakes/): its real engine pool over in-memory
engines, the data plane, the prompt ledger and the trainer's progress in memory; no Redis, gRPC or processes.
`Rollout.go()` runs the role while playing the trainer: once step N's partition is sealed it moves the engines to
version N + 1 and the progress past step N. What each sample must hold follows from the fake engines' rules
(tests/fakes/engines.py). The fixtures (model_dir, tokenizer, prompts) are in conftest.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.rollout.config import RolloutConfig
from services.rollout.engine_pool import EnginePool
from services.rollout.service import RolloutService
from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_state.trainer_progress import TrainerProgress
from services.role.role_service import RoleStatus
from tests.fakes import FakeEngines, FakeMembership, FakeRunSession, InMemoryDataPlane, InMemoryLedger, ProgressBox
from tests.fakes.engines import sample_length, token

PROMPTS = ["What is 1 + 1?", "Name a colour.", "What is 2 + 5?"]  # row i has label i
N = 2  # samples per prompt
RUN_ID = "default"


def score(response, fields, prompt):
    """The run's reward (import:tests.rollout.rollout_harness:score): the row's label, plus the text's length."""
    return float(fields["label"]) + len(response) / 1000


def make_run(model_dir: str, prompts: str, groups_per_step: int = 2, **fields) -> RunConfig:
    return RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=N,
        rollout_batch_size=groups_per_step,
        global_batch_size=groups_per_step * N,
        micro_batch_size=N,
        **fields,
        rollout={
            "prompts": prompts,
            "reward": "import:tests.rollout.rollout_harness:score",
            "apply_chat_template": False,
            "max_new_tokens": 8,
        },
    )


@dataclass
class Rollout:
    run: RunConfig
    plane: InMemoryDataPlane = field(default_factory=InMemoryDataPlane)
    ledger: InMemoryLedger = field(default_factory=InMemoryLedger)
    engines: FakeEngines = field(default_factory=FakeEngines)
    progress: ProgressBox = field(default_factory=ProgressBox)
    memberships: list[FakeMembership] = field(default_factory=list)
    pools: list[EnginePool] = field(default_factory=list)
    evaluations: object = None  # where eval results go, when the run has eval.prompts
    source_rewards: object = None  # reward per data source and step (services/run_state/source_rewards.py)
    judge_client: object = None  # a model:... reward's client factory (an in-memory judge), when the run has one
    service: RolloutService | None = None

    def sealed(self, step: int) -> bool:
        p = self.plane.partitions.get(partition_name("r", step))
        return p is not None and p.sealed

    async def play_trainer(self) -> None:
        for step in range(self.progress.value.next_step, self.run.num_steps):
            while not self.sealed(step):
                await asyncio.sleep(0.005)
            self.engines.set_version(step + 1)  # publish the weights trained on step N ...
            self.progress.value = TrainerProgress(next_step=step + 1, version=step + 1)  # ... and move past it

    def go(self) -> "Rollout":
        """Run the role until the run's steps are generated and trained."""
        session = FakeRunSession(
            self.run,
            self.plane,
            progress=self.progress,
            ledger=self.ledger,
            evaluations=self.evaluations,
            source_rewards=self.source_rewards,
            run_id=RUN_ID,
        )
        self.memberships = session.memberships  # the rollout's own first, then its engines'

        def pool(config):
            self.pools.append(EnginePool(config.engine_urls, client=self.engines.client))
            return self.pools[-1]

        config = RolloutConfig(
            run_id=RUN_ID,
            engine_url="http://engine-0:1,http://engine-1:1",
            register_engines=False,
            version_poll_s=0.01,
            lost_check_s=0.01,
        )
        seams = {"judge_client": self.judge_client} if self.judge_client is not None else {}
        self.service = service = RolloutService(config, RoleStatus("rollout"), engines=pool, **seams)

        async def both():
            await asyncio.wait_for(asyncio.gather(service.run_loop(session, asyncio.Event()), self.play_trainer()), 60)

        asyncio.run(both())
        return self

    def groups(self) -> dict[int, list[dict]]:
        """prompt position -> its rows, over every partition."""
        out: dict[int, list[dict]] = {}
        for name, p in self.plane.partitions.items():
            for row in p.rows:
                out.setdefault(int(row["prompt_position"]), []).append({**row, "partition": name})
        return out

    def begun_under(self) -> dict[int, int]:
        """prompt position -> the engine version its group's first request met."""
        return {int(rid.split("-")[1]): r.version for rid, r in self.engines.first_requests().items()}


def expected_response(position: int, k: int) -> tuple[int, list[int]]:
    seed = position * 4099 + k  # the rollout's sampling seed of sample k (optim.seed 0)
    return seed, [token(seed, j) for j in range(sample_length(seed))]
