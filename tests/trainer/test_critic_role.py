"""The critic role against in-memory fakes of its seams (tests/fakes/): it writes `values` for every row
of a step, then, once the advantage role's `returns` are there, trains on them and acks every row."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from services.role.role_service import RoleStatus
from services.trainer.config import TrainerConfig
from services.trainer.critic_service import CriticTrainer
from tests.fakes import FakeRunSession, InMemoryDataPlane


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=5)


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _critic_on_one_step(model_dir, responses):
    """(plane, session, status, worker): a critic running on step 0 of run r, prompts of 2 samples each."""
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=1,
        algorithm={"estimator": "ppo"},
    )
    plane = InMemoryDataPlane()
    plane.create_partition("r/train_0", group_size=2)
    prompts = [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    plane.put(
        "r/train_0",
        {
            "tokens": [torch.tensor(p + r) for p, r in zip(prompts, responses)],
            "prompt_length": torch.tensor([len(p) for p in prompts]),
            "response_length": torch.tensor([len(r) for r in responses]),
            "loss_mask": [torch.ones(len(r)) for r in responses],
        },
    )
    plane.seal_partition("r/train_0")
    session, status = FakeRunSession(run, plane), RoleStatus("critic")
    critic = CriticTrainer(TrainerConfig(role="critic"), status)
    worker = threading.Thread(target=critic.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()
    return plane, session, status, worker


def test_critic_writes_values_then_trains_on_returns(model_dir):
    responses = [[1, 2, 3], [4], [10, 11], [12, 13]]
    plane, session, status, worker = _critic_on_one_step(model_dir, responses)
    _wait(lambda: all(v is not None for v in plane.column("r/train_0", "values")))
    values = plane.column("r/train_0", "values")
    assert [len(v) for v in values] == [len(r) for r in responses]
    assert (
        "critic_train" not in plane.partitions["r/train_0"].consumed
        or not plane.partitions["r/train_0"].consumed["r/critic_train"]
    )  # no returns yet: nothing to train on
    plane.put("r/train_0", {"returns": [torch.ones(len(r)) for r in responses]}, rows=[0, 1, 2, 3])
    worker.join(60)
    assert not worker.is_alive(), "the critic did not finish the step"

    assert plane.partitions["r/train_0"].consumed["r/critic_values"] == {0, 1, 2, 3}
    assert plane.partitions["r/train_0"].consumed["r/critic_train"] == {0, 1, 2, 3}
    assert session.membership.steps == [0]
    loss = status.snapshot()["value_loss"]
    assert loss > 0 and loss == loss  # a real, finite value loss against the returns


def test_critic_trains_what_is_left_when_rows_the_actor_trained_were_lost(model_dir):
    """Rows lost with a shard after the actor trained them are not generated again: the critic, which had
    not trained them yet, trains the rest of the step as a short batch instead of waiting for them."""
    plane, session, _, worker = _critic_on_one_step(model_dir, [[1, 2, 3], [4], [10, 11], [12, 13]])
    _wait(lambda: all(v is not None for v in plane.column("r/train_0", "values")))
    plane.lose("r/train_0", [2])  # group 1: the critic_train task had not consumed it
    plane.seal_partition("r/train_0")  # as the rollout does: the actor had trained it, nothing to replace
    plane.put("r/train_0", {"returns": [torch.ones(3), torch.ones(1)]}, rows=[0, 1])
    worker.join(60)
    assert not worker.is_alive(), "the critic waited for rows that will never come"
    assert plane.acked_rows("r/train_0", "r/critic_train") == [0, 1]
    assert session.membership.steps == [0]
