"""The forward role (as `reference`) against in-memory fakes of its seams (tests/fakes.py): the
log-probs it writes are the model's teacher-forced log-probs of each response, row for row."""

from __future__ import annotations

import threading

import pytest
import torch

from services.forward.config import ForwardConfig
from services.forward.service import ForwardService
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.response_batch import ResponseBatch, response_log_probs
from services.run_contract.run_config import RunConfig
from services.run_state.connections import RunConnections
from services.run_state.step_partitions import StepPartitions
from services.run_state.trainer_progress import TrainerProgress
from services.runtime.role_service import RoleStatus
from tests.fakes import FakeMembership, InMemoryDataPlane


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=3)


def _sample_rows(plane: InMemoryDataPlane, partition: str, prompts, responses) -> None:
    tokens = [torch.tensor(p + r) for p, r in zip(prompts, responses)]
    plane.put(partition, {"tokens": tokens, "prompt_length": torch.tensor([len(p) for p in prompts]),
                          "response_length": torch.tensor([len(r) for r in responses])})


def test_reference_writes_teacher_forced_log_probs_of_every_response(model_dir):
    torch.set_num_threads(1)
    run = RunConfig(name="r", model=model_dir, n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4,
                    micro_batch_size=2, num_steps=1, algorithm={"kl_coef": 0.1})
    plane = InMemoryDataPlane()
    plane.create_partition("train_0", group_size=2)
    prompts, responses = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]], [[1, 2], [3], [4, 5, 6], [8]]
    _sample_rows(plane, "train_0", prompts, responses)
    plane.seal_partition("train_0")
    conn = RunConnections(dcs=None, run=run, tq=plane, redis=None,
                          steps=StepPartitions(plane, lambda: TrainerProgress(next_step=0, version=0), run, poll_s=0))
    membership = FakeMembership()
    service = ForwardService(ForwardConfig(role="reference"), RoleStatus("reference"),
                             connect=lambda config, halt: conn, join=lambda dcs, registration: membership)
    worker = threading.Thread(target=service.run_loop, args=(threading.Event(),), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the role did not finish the run's step"

    written = plane.column("train_0", "ref_log_probs")
    model, _ = load_causal_lm(model_dir)
    batch = ResponseBatch.build([torch.tensor(p + r) for p, r in zip(prompts, responses)],
                                [len(p) for p in prompts], [len(r) for r in responses])
    expected = response_log_probs(model, batch, run.rollout.temperature)
    for row, response in enumerate(responses):
        assert written[row].shape == (len(response),)
        torch.testing.assert_close(written[row], expected[row, :len(response)], atol=1e-5, rtol=0)
    assert plane.partitions["train_0"].consumed["reference"] == {0, 1, 2, 3}
    assert membership.closed
