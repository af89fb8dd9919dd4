"""The rollout role against in-memory fakes of its seams (tests/fakes/): its real engine pool over in-memory
engines, the data plane, the prompt ledger and the trainer's progress in memory; no Redis, gRPC or processes.
The test plays the trainer: once step N's partition is sealed it moves the engines to version N + 1 and the
progress past step N. What each sample must hold follows from the fake engines' rules (tests/fakes/engines.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoTokenizer

from services.model.init_model import init_model
from services.rollout.config import RolloutConfig
from services.rollout.connections import RolloutConnections
from services.rollout.engine_pool import EnginePool
from services.rollout.service import RECOVER_TASK, RolloutService
from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_state.trainer_progress import TrainerProgress
from services.runtime.role_service import RoleStatus
from tests.fakes import (AsyncInMemoryDataPlane, FakeEngines, FakeMembership, InMemoryDataPlane, InMemoryLedger,
                         ProgressBox)
from tests.fakes.engines import log_prob, sample_length, token

PROMPTS = ["What is 1 + 1?", "Name a colour.", "What is 2 + 5?"]  # row i has label i
N = 2                                                              # samples per prompt
RUN_ID = "default"


def score(response, fields, prompt):
    """The run's reward (import:tests.rollout.test_rollout_role:score): the row's label, plus the text's length."""
    return float(fields["label"]) + len(response) / 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=3)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": i}) + "\n" for i, p in enumerate(PROMPTS)))
    return str(path)


def make_run(model_dir: str, prompts: str, groups_per_step: int = 2, **fields) -> RunConfig:
    return RunConfig(name="r", model=model_dir, n_samples_per_prompt=N, rollout_batch_size=groups_per_step,
                     global_batch_size=groups_per_step * N, micro_batch_size=N, **fields,
                     rollout={"prompts": prompts, "reward": "import:tests.rollout.test_rollout_role:score",
                              "apply_chat_template": False, "max_new_tokens": 8})


@dataclass
class Rollout:
    run: RunConfig
    plane: InMemoryDataPlane = field(default_factory=InMemoryDataPlane)
    ledger: InMemoryLedger = field(default_factory=InMemoryLedger)
    engines: FakeEngines = field(default_factory=FakeEngines)
    progress: ProgressBox = field(default_factory=ProgressBox)
    memberships: list[FakeMembership] = field(default_factory=list)
    pools: list[EnginePool] = field(default_factory=list)

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
        async def connect(config, stop):
            return RolloutConnections(None, self.run, AsyncInMemoryDataPlane(self.plane), self.ledger,
                                      self.progress.aread)

        def join(dcs, registration):
            self.memberships.append(FakeMembership(dcs, registration))
            return self.memberships[-1]

        def pool(config):
            self.pools.append(EnginePool(config.engine_urls, client=self.engines.client))
            return self.pools[-1]
        config = RolloutConfig(run_id=RUN_ID, engine_url="http://engine-0:1,http://engine-1:1",
                               register_engines=False, version_poll_s=0.01)
        service = RolloutService(config, RoleStatus("rollout"), connect=connect, join=join, engines=pool)

        async def both():
            await asyncio.wait_for(asyncio.gather(service.run_loop(asyncio.Event()), self.play_trainer()), 60)
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


def test_writes_every_group_once_with_the_fields_of_its_samples(model_dir, prompts, tokenizer):
    r = Rollout(make_run(model_dir, prompts, num_steps=2, max_staleness=1)).go()

    groups = r.groups()
    assert sorted(groups) == [0, 1, 2, 3]  # every group of the run, none twice
    begun = r.begun_under()
    for position, rows in groups.items():
        assert [int(row["sample_index"]) for row in rows] == list(range(N))
        prompt = tokenizer.encode(PROMPTS[position % len(PROMPTS)], add_special_tokens=False)
        version = begun[position]
        for k, row in enumerate(rows):
            seed, response = expected_response(position, k)
            assert row["partition"] == partition_name("r", position // 2) and int(row["step"]) == position // 2
            assert row["tokens"].tolist() == prompt + response
            assert int(row["prompt_length"]) == len(prompt) and int(row["response_length"]) == len(response)
            assert row["loss_mask"].tolist() == [1.0] * len(response)
            assert int(row["weight_version"]) == version
            assert row["token_weight_versions"].tolist() == [version] * len(response)
            torch.testing.assert_close(row["rollout_log_probs"],
                                       torch.tensor([log_prob(version, j) for j in range(len(response))]))
            text = tokenizer.decode(response, skip_special_tokens=True)
            assert float(row["reward"]) == pytest.approx(position % len(PROMPTS) + len(text) / 1000)
    assert all(r.sealed(step) for step in range(2))
    # one request per group: its samples together, each the group's prompt
    assert sorted(int(q.rids[0].split("-")[1]) for q in r.engines.requests) == [0, 1, 2, 3]
    assert all(q.inputs == [q.inputs[0]] * N and len({rid.rsplit("-", 1)[0] for rid in q.rids}) == 1
               for q in r.engines.requests)
    assert (r.ledger.frontier, r.ledger.written, sorted(r.ledger.marks)) == (4, set(), [0, 1, 2, 3])
    membership = r.memberships[0]
    assert membership.registration.role == "rollout" and sorted(membership.steps) == [0, 0, 1, 1]
    assert membership.closed and all(c.closed for c in r.engines.clients)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_admission_never_starts_a_group_beyond_the_staleness_bound(model_dir, prompts, max_staleness):
    r = Rollout(make_run(model_dir, prompts, num_steps=4, max_staleness=max_staleness)).go()

    begun = r.begun_under()
    assert sorted(begun) == list(range(8)) and sorted(r.groups()) == list(range(8))
    for position, version in begun.items():
        assert position // 2 <= version + max_staleness  # step N is trained at version N
    step_one = {begun[2], begun[3]}
    if max_staleness == 0:
        assert all(version == position // 2 for position, version in begun.items())  # on-policy
    else:
        assert step_one == {0}  # ran ahead: step 1 generated before step 0 was trained


def test_a_weight_update_mid_generation_resumes_the_samples_under_the_new_version(model_dir, prompts, tokenizer):
    r = Rollout(make_run(model_dir, prompts, groups_per_step=1, num_steps=1, max_staleness=0))
    r.engines.abort_next(after_tokens=2)
    r.go()

    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    first, resumed = r.engines.requests
    assert (first.version, resumed.version) == (0, 1)
    rows = r.plane.partitions["r/train_0"].rows
    for k, row in enumerate(rows):
        seed, response = expected_response(0, k)
        assert resumed.inputs[k] == prompt + response[:2]  # prompt + the partial output, continued
        assert row["tokens"].tolist() == prompt + response
        assert int(row["weight_version"]) == 0  # the version its generation began under
        assert row["token_weight_versions"].tolist() == [0, 0] + [1] * (len(response) - 2)
        torch.testing.assert_close(row["rollout_log_probs"], torch.tensor(
            [log_prob(0, 0), log_prob(0, 1)] + [log_prob(1, j) for j in range(2, len(response))]))
    assert r.pools[0].resubmits == N


def test_a_restarted_rollout_neither_skips_nor_repeats_a_group(model_dir, prompts):
    """The previous rollout wrote groups 0 and 1 of step 0 but died before marking group 1 in the ledger."""
    r = Rollout(make_run(model_dir, prompts, num_steps=2, max_staleness=1), ledger=InMemoryLedger(frontier=1,
                                                                                                 steps={0: {0}}))
    r.plane.create_partition("r/train_0", group_size=N)
    for position in (0, 1):
        r.plane.put("r/train_0", {"prompt_position": torch.tensor([position] * N), "sample_index": torch.arange(N)})
    r.go()

    assert sorted(r.begun_under()) == [2, 3]  # only the groups not yet written were generated
    assert r.sealed(0) and len(r.plane.partitions["r/train_0"].rows) == 2 * N  # recovery sealed step 0 as it was
    assert sorted({int(row["prompt_position"]) for row in r.plane.partitions["r/train_1"].rows}) == [2, 3]
    assert r.plane.tasks["r/" + RECOVER_TASK] == ["prompt_position"] and not r.plane.leases  # its read was released
    assert r.ledger.frontier == 4 and r.ledger.marks[:2] == [0, 1]  # group 1 marked from the partition first
