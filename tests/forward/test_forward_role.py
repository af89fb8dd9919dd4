"""The forward role against in-memory fakes of its seams (tests/fakes/): the log-probs it writes are the
teacher-forced log-probs of each response, row for row, under the reference weights (`reference`) or under the
weights the row's step is trained with, taken from the weight broadcast as they are published (`actor_fwd`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.forward.config import ForwardConfig
from services.forward.service import ForwardService
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.response_batch import ResponseBatch, response_log_probs
from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_state.trainer_progress import TrainerProgress
from services.role.role_service import RoleStatus
from tests.fakes import FakeRunSession, InMemoryCoordinator, InMemoryDataPlane, ProgressBox

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=3)


def _sample_rows(plane: InMemoryDataPlane, partition: str, prompts, responses) -> None:
    tokens = [torch.tensor(p + r) for p, r in zip(prompts, responses)]
    plane.put(
        partition,
        {
            "tokens": tokens,
            "prompt_length": torch.tensor([len(p) for p in prompts]),
            "response_length": torch.tensor([len(r) for r in responses]),
        },
    )


def test_reference_writes_teacher_forced_log_probs_of_every_response(model_dir):
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=1,
        algorithm={"kl_coef": 0.1},
    )
    plane = InMemoryDataPlane()
    plane.create_partition("r/train_0", group_size=2)
    prompts, responses = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]], [[1, 2], [3], [4, 5, 6], [8]]
    _sample_rows(plane, "r/train_0", prompts, responses)
    plane.seal_partition("r/train_0")
    session = FakeRunSession(run, plane)
    service = ForwardService(ForwardConfig(role="reference"), RoleStatus("reference"))
    worker = threading.Thread(target=service.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the role did not finish the run's step"

    written = plane.column("r/train_0", "ref_log_probs")
    model, _ = load_causal_lm(model_dir)
    batch = ResponseBatch.build(
        [torch.tensor(p + r) for p, r in zip(prompts, responses)],
        [len(p) for p in prompts],
        [len(r) for r in responses],
    )
    expected = response_log_probs(model, batch, run.rollout.temperature)
    for row, response in enumerate(responses):
        assert written[row].shape == (len(response),)
        torch.testing.assert_close(written[row], expected[row, : len(response)], atol=1e-5, rtol=0)
    assert plane.partitions["r/train_0"].consumed["r/reference"] == {0, 1, 2, 3}
    assert session.membership.closed


def _expected(model, prompts, responses, temperature: float) -> list[torch.Tensor]:
    batch = ResponseBatch.build(
        [torch.tensor(p + r) for p, r in zip(prompts, responses)],
        [len(p) for p in prompts],
        [len(r) for r in responses],
    )
    with torch.no_grad():
        out = response_log_probs(model, batch, temperature)
    return [out[i, : len(r)] for i, r in enumerate(responses)]


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_actor_fwd_writes_each_step_under_the_weights_that_step_is_trained_with(model_dir, tmp_path):
    """Step 1 is trained with version 1: actor_fwd waits for it before claiming train_1, though the rows are
    there from the start, and writes the teacher-forced log-probs of the version it holds."""
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
        algorithm={"decoupled": True, "proximal_policy": "current"},
    )
    plane, coordinator, progress = InMemoryDataPlane(), InMemoryCoordinator(), ProgressBox()
    prompts, responses = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]], [[1, 2], [3], [4, 5, 6], [8]]
    for step in range(2):
        plane.create_partition(partition_name("r", step), group_size=2)
        _sample_rows(plane, partition_name("r", step), prompts, responses)
        plane.seal_partition(partition_name("r", step))
    session = FakeRunSession(run, plane, coordinator=coordinator, progress=progress)
    service = ForwardService(ForwardConfig(role="actor_fwd"), RoleStatus("actor_fwd"), receiver=coordinator.receiver)
    worker = threading.Thread(target=service.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()

    _wait(lambda: all(v is not None for v in plane.column("r/train_0", "log_probs")))
    assert all(v is None for v in plane.column("r/train_1", "log_probs"))  # version 1 is not there yet
    newer, _ = load_causal_lm(init_model(str(tmp_path / "v1"), preset="tiny", arch="qwen2", seed=11), "float32")
    coordinator.publish(newer.named_parameters(), 1, ["engine", "actor_fwd"])  # the trainer's publish of step 0
    _wait(lambda: all(v is not None for v in plane.column("r/train_1", "log_probs")))
    progress.value = TrainerProgress(next_step=2, version=2)  # training is done: the role stops following
    worker.join(30)
    assert not worker.is_alive(), "the role did not finish the run's steps"

    initial, _ = load_causal_lm(model_dir, "float32")
    for step, model in enumerate([initial, newer]):
        expected = _expected(model, prompts, responses, run.rollout.temperature)
        for written, want in zip(plane.column(partition_name("r", step), "log_probs"), expected):
            torch.testing.assert_close(written, want, atol=1e-5, rtol=0)
        assert plane.acked_rows(partition_name("r", step), "r/actor_fwd") == [0, 1, 2, 3]
    other = _expected(initial, prompts, responses, run.rollout.temperature)
    assert all(not torch.allclose(a, b, atol=1e-3) for a, b in zip(other, plane.column("r/train_1", "log_probs")))
    receiver = coordinator.receivers[0]
    assert receiver.declared and receiver.loads == [1] and coordinator.cursors["actor_fwd"] == 1
    membership = session.membership
    assert max(membership.versions) == 1 and membership.closed and receiver.closed


def test_actor_fwd_scores_each_step_with_the_version_before_the_one_it_trains_with(model_dir, tmp_path):
    """proximal_policy previous: step N is trained with version N here, so steps 0 and 1 are scored with version 0
    and step 2 with version 1. Version 1 is published before step 0 is scored: the role keeps version 0 beside it
    and scores steps 0 and 1 with that copy, then waits for nothing more before step 2."""
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=3,
        algorithm={"decoupled": True},
    )
    assert run.algorithm.proximal_policy == "previous"  # the default
    plane, coordinator, progress = InMemoryDataPlane(), InMemoryCoordinator(), ProgressBox()
    prompts, responses = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]], [[1, 2], [3], [4, 5, 6], [8]]
    for step in range(3):
        plane.create_partition(partition_name("r", step), group_size=2)
        _sample_rows(plane, partition_name("r", step), prompts, responses)
        plane.seal_partition(partition_name("r", step))
    newer, _ = load_causal_lm(init_model(str(tmp_path / "v1"), preset="tiny", arch="qwen2", seed=11), "float32")
    coordinator.publish(newer.named_parameters(), 1, ["engine", "actor_fwd"])
    session = FakeRunSession(run, plane, coordinator=coordinator, progress=progress)
    service = ForwardService(ForwardConfig(role="actor_fwd"), RoleStatus("actor_fwd"), receiver=coordinator.receiver)
    worker = threading.Thread(target=service.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()
    _wait(lambda: all(v is not None for v in plane.column("r/train_2", "log_probs")))
    progress.value = TrainerProgress(next_step=3, version=3)
    worker.join(30)
    assert not worker.is_alive(), "the role did not finish the run's steps"

    initial, _ = load_causal_lm(model_dir, "float32")
    for step, model in enumerate([initial, initial, newer]):
        expected = _expected(model, prompts, responses, run.rollout.temperature)
        for written, want in zip(plane.column(partition_name("r", step), "log_probs"), expected):
            torch.testing.assert_close(written, want, atol=1e-5, rtol=0)
    assert coordinator.receivers[0].loads == [1]
