"""The advantage role against in-memory fakes of its seams (tests/fakes/): no Redis, gRPC or processes.
The multi-process end-to-end tests run it for real."""

from __future__ import annotations

import threading

import torch

from services.advantage.config import AdvantageConfig
from services.advantage.service import AdvantageService
from services.run_contract.run_config import RunConfig
from services.role.role_service import RoleStatus
from tests.fakes import FakeMembership, FakeRunSession, InMemoryDataPlane


def _run_role(run: RunConfig, plane: InMemoryDataPlane) -> FakeMembership:
    session = FakeRunSession(run, plane)
    service = AdvantageService(AdvantageConfig(), RoleStatus("advantage"))
    worker = threading.Thread(target=service.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the role did not finish the run's steps"
    return session.membership


def test_grpo_advantages_per_group_on_every_response_token():
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=1,
        algorithm={"estimator": "grpo"},
    )
    plane = InMemoryDataPlane()
    plane.create_partition("r/train_0", group_size=2)
    rewards = [1.0, 0.0, 0.5, 0.5]  # group 0 differs, group 1 ties
    lengths = [3, 2, 1, 4]
    plane.put(
        "r/train_0",
        {
            "reward": torch.tensor(rewards),
            "response_length": torch.tensor(lengths),
            "loss_mask": [torch.ones(n) for n in lengths],
        },
    )
    plane.seal_partition("r/train_0")

    membership = _run_role(run, plane)

    advantages = plane.column("r/train_0", "advantages")
    assert [len(a) for a in advantages] == lengths  # one value per response token
    first, second = advantages[0][0].item(), advantages[1][0].item()
    assert first > 0 > second and abs(first + second) < 1e-6  # the better sample of the group is pushed up
    assert all(torch.all(a == a[0]) for a in advantages)  # GRPO: one advantage per sample
    assert all(float(a.abs().max()) == 0.0 for a in advantages[2:])  # a tied group teaches nothing
    assert all(torch.equal(r, a) for r, a in zip(plane.column("r/train_0", "returns"), advantages))
    assert membership.steps == [0]  # progress reported once the step's partition was done
    assert plane.partitions["r/train_0"].consumed["r/advantage"] == {0, 1, 2, 3}  # every row acked


def test_walks_every_step_of_the_run():
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
        algorithm={"estimator": "rloo"},
    )
    plane = InMemoryDataPlane()
    plane.create_partition("r/train_0", group_size=2)
    plane.put(
        "r/train_0",
        {
            "reward": torch.tensor([1.0, 3.0]),
            "response_length": torch.tensor([1, 1]),
            "loss_mask": [torch.ones(1), torch.ones(1)],
        },
    )
    plane.seal_partition("r/train_0")
    plane.create_partition("r/train_1", group_size=2)
    plane.put(
        "r/train_1",
        {
            "reward": torch.tensor([2.0, 2.0]),
            "response_length": torch.tensor([2, 2]),
            "loss_mask": [torch.ones(2), torch.ones(2)],
        },
    )
    plane.seal_partition("r/train_1")

    membership = _run_role(run, plane)

    # RLOO: each sample against the mean of the others in its group
    assert [a.tolist() for a in plane.column("r/train_0", "advantages")] == [[-2.0], [2.0]]
    assert [a.tolist() for a in plane.column("r/train_1", "advantages")] == [[0.0, 0.0], [0.0, 0.0]]
    assert membership.steps == [0, 1]
