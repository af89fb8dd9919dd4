"""The actor trainer's final checkpoint (checkpoint.on_stop), against the in-memory fakes of its seams: halted
between steps it checkpoints the last finished step with the weights it published; halted inside a step whose
first optimizer iteration already moved the weights it writes none (those weights are no step's)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import checkpoints
from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_state.trainer_progress import read_progress
from services.role.role_service import RoleStatus
from services.trainer.config import TrainerConfig
from services.trainer.service import ActorTrainer
from services.trainer.tasks import ACTOR_TASK
from tests.fakes import FakeRunSession, InMemoryCoordinator, InMemoryDataPlane, InMemoryRedis

RUN_ID = "final-ckpt"
ROWS = [([5, 6, 7], [1, 2]), ([5, 6, 7], [3]), ([9, 10], [4, 5, 6]), ([9, 10], [8])]  # (prompt, response)


@pytest.fixture(autouse=True)
def _fresh_trainer_metrics(fresh_trainer_metrics):
    """Every test here may make an ActorTrainer (tests/trainer/conftest.py)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=3)


def put_rows(plane: InMemoryDataPlane, step: int, rows: list[int], seal: bool) -> None:
    """Rows of train_<step> as the rollout and the advantage role leave them."""
    name = partition_name("r", step)
    plane.create_partition(name, group_size=2, exist_ok=True)
    picked = [ROWS[i] for i in rows]
    plane.put(
        name,
        {
            "tokens": [torch.tensor(p + r) for p, r in picked],
            "prompt_length": torch.tensor([len(p) for p, _ in picked]),
            "response_length": torch.tensor([len(r) for _, r in picked]),
            "loss_mask": [torch.ones(len(r)) for _, r in picked],
            "rollout_log_probs": [torch.full((len(r),), -5.0) for _, r in picked],
            "reward": torch.tensor([1.0 - i % 2 for i in rows]),
            "weight_version": torch.zeros(len(rows), dtype=torch.int64),
            "prompt_position": torch.tensor([2 * step + i // 2 for i in rows]),
            "sample_index": torch.tensor([i % 2 for i in rows]),
            "advantages": [torch.full((len(r),), 1.0 - 2 * (i % 2)) for i, (_, r) in zip(rows, picked)],
        },
    )
    if seal:
        plane.seal_partition(name)
    plane.register_task("r/advantage", ["advantages"], group_size=2)
    plane.ack(plane.claim_rows(name, "r/advantage", len(rows)).lease_id)


def start(run: RunConfig, plane, checkpoint_dir: str):
    redis, coordinator = InMemoryRedis(), InMemoryCoordinator()
    session = FakeRunSession(run, plane, coordinator=coordinator, redis=redis, run_id=RUN_ID, poll_s=0.01)
    trainer = ActorTrainer(
        TrainerConfig(run_id=RUN_ID, checkpoint_dir=checkpoint_dir),
        RoleStatus("trainer"),
        publisher=coordinator.publisher,
    )
    halt = threading.Event()
    worker = threading.Thread(target=trainer.run_loop, args=(session, halt), daemon=True)
    worker.start()
    return worker, halt, redis, coordinator


def wait_until(done, worker: threading.Thread) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert worker.is_alive() and time.monotonic() < deadline, "the trainer stopped or hangs"
        time.sleep(0.02)


def test_halted_between_steps_it_checkpoints_the_last_finished_step(model_dir, tmp_path):
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=3,
        optim={"lr": 1e-2},
    )
    plane = InMemoryDataPlane()
    put_rows(plane, 0, [0, 1, 2, 3], seal=True)
    worker, halt, redis, coordinator = start(run, plane, str(tmp_path))
    wait_until(lambda: read_progress(redis, RUN_ID).next_step == 1, worker)  # step 1 never comes
    assert checkpoints(str(tmp_path), "actor") == []  # no interval: nothing yet
    halt.set()  # SIGTERM
    worker.join(60)
    assert not worker.is_alive()
    [state] = checkpoints(str(tmp_path), "actor")
    assert (
        (state.next_step, state.version)
        == (1, 1)
        == (read_progress(redis, RUN_ID).next_step, read_progress(redis, RUN_ID).version)
    )
    saved, _ = load_causal_lm(state.path)
    [published] = coordinator.published
    for name, param in saved.named_parameters():  # the weights of the step, as published
        assert torch.equal(param, published.tensors[name]), name


def test_halted_inside_a_step_whose_weights_moved_it_writes_no_checkpoint(model_dir, tmp_path):
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=2,
        micro_batch_size=2,
        num_steps=2,
        optim={"lr": 1e-2},
    )  # two optimizer iterations a step
    plane = InMemoryDataPlane()
    put_rows(plane, 0, [0, 1, 2, 3], seal=True)
    put_rows(plane, 1, [0, 1], seal=False)  # step 1's second group is still being generated
    worker, halt, redis, coordinator = start(run, plane, str(tmp_path))
    partition = partition_name("r", 1)
    wait_until(lambda: plane.acked_rows(partition, "r/" + ACTOR_TASK) == [0, 1], worker)  # step 1, iteration 0
    halt.set()
    worker.join(60)
    assert not worker.is_alive()
    assert [p.version for p in coordinator.published] == [1]  # step 0 finished and was published
    assert read_progress(redis, RUN_ID).next_step == 1  # step 1 is trained again after a restart
    assert checkpoints(str(tmp_path), "actor") == []  # not step 0's weights any more: no checkpoint at all
