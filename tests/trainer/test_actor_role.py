"""The actor trainer against in-memory fakes of its seams (tests/fakes/): the data plane, its membership, the
weight broadcast and the Redis progress record in memory. Rows the rollout and advantage roles would have
written are put before it starts; it trains two steps and the test checks what it claimed, trained, published,
acked, cleared and recorded, against the same optimizer steps taken here by hand."""

from __future__ import annotations

import threading

import pytest
import torch

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.response_batch import ResponseBatch, response_log_probs
from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_contract.sample_fields import actor_inputs
from services.run_state.trainer_progress import TrainerProgress, read_progress, trained_steps
from services.role.role_service import RoleStatus
from services.trainer.optimizer import adamw, set_lr
from services.trainer.actor_update import actor_step
from services.trainer.config import TrainerConfig
from services.trainer.service import ActorTrainer
from services.trainer.tasks import ACTOR_TASK
from tests.fakes import FakeMembership, FakeRunSession, InMemoryCoordinator, InMemoryDataPlane, InMemoryRedis

RUN_ID = "actor-test"
PROMPTS = [[5, 6, 7], [9, 10]]
RESPONSES = [[[1, 2], [3]], [[4, 5, 6], [8]]]  # per prompt, its group of 2 samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def write_step(plane: InMemoryDataPlane, step: int, initial_model, temperature: float) -> None:
    """train_<step> as the rollout (generating under version 0) and the advantage role leave it."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    responses = [r for group in RESPONSES for r in group]
    tokens = [torch.tensor(p + r) for p, r in zip(prompts, responses)]
    batch = ResponseBatch.build(tokens, [len(p) for p in prompts], [len(r) for r in responses])
    with torch.no_grad():
        rollout = response_log_probs(initial_model, batch, temperature)
    signs = [1.0, -1.0, -1.0, 1.0] if step == 0 else [-1.0, 1.0, 1.0, -1.0]
    plane.create_partition(partition_name("r", step), group_size=2)
    plane.put(
        partition_name("r", step),
        {
            "tokens": tokens,
            "prompt_length": torch.tensor([len(p) for p in prompts]),
            "response_length": torch.tensor([len(r) for r in responses]),
            "loss_mask": [torch.ones(len(r)) for r in responses],
            "rollout_log_probs": [rollout[i, : len(r)].clone() for i, r in enumerate(responses)],
            "reward": torch.tensor([1.0, 0.0, 0.0, 1.0]),
            "weight_version": torch.zeros(4, dtype=torch.int64),
            "prompt_position": torch.tensor([2 * step, 2 * step, 2 * step + 1, 2 * step + 1]),
            "sample_index": torch.tensor([0, 1, 0, 1]),
            "advantages": [torch.full((len(r),), s) for r, s in zip(responses, signs)],
        },
    )
    plane.seal_partition(partition_name("r", step))
    plane.register_task("r/advantage", ["advantages"], group_size=2)
    plane.ack(plane.claim_rows(partition_name("r", step), "r/advantage", 4).lease_id)  # the advantage role is done


class ReportsAtFinish(InMemoryCoordinator):
    """Notes the progress the trainer had reported when it finished the run."""

    reported_at_finish: int | None = None

    def finish_run(self, run_id: str) -> None:
        self.reported_at_finish = self.steps(run_id).next_step
        super().finish_run(run_id)


def test_trains_each_step_on_its_rows_publishes_the_next_version_and_acks_each_row_once(model_dir):
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
        max_staleness=1,
        optim={"lr": 1e-2, "lr_schedule": "linear", "min_lr_ratio": 0.5},
    )
    initial, _ = load_causal_lm(model_dir, "float32")
    # each publish takes a while, as a broadcast does: the next step trains meanwhile, and numbers its version
    # after the publish in flight
    plane, redis, coordinator = InMemoryDataPlane(), InMemoryRedis(), ReportsAtFinish(broadcast_s=0.5)
    for step in range(2):
        write_step(plane, step, initial, run.rollout.temperature)
    batches = [plane.get(partition_name("r", step), [0, 1, 2, 3], actor_inputs(run)) for step in range(2)]
    session = FakeRunSession(run, plane, coordinator=coordinator, redis=redis, run_id=RUN_ID)
    status = RoleStatus("trainer")
    trainer = ActorTrainer(TrainerConfig(run_id=RUN_ID), status, publisher=coordinator.publisher)
    worker = threading.Thread(target=trainer.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the trainer did not finish the run's steps"

    # the same two optimizer steps, by hand, on the same rows: what each published version must hold
    model, _ = load_causal_lm(model_dir, "float32")
    optimizer = adamw(model.parameters(), run.optim.lr, run.optim.betas, run.optim.weight_decay, "cpu")
    assert [(p.version, p.receiver_roles, p.announced) for p in coordinator.published] == [
        (1, ["engine"], True),
        (2, ["engine"], True),
    ]
    for step, published in enumerate(coordinator.published):
        assert set_lr(optimizer, run.optim.lr, step, run.optim, run.num_steps) == [1e-2, 5e-3][step]
        m = actor_step(model, optimizer, batches[step], run, run.micro_batch_size)
        assert m.loss == m.loss and m.grad_norm > 0  # a real loss with a gradient
        for name, expected in model.named_parameters():
            torch.testing.assert_close(published.tensors[name], expected.detach(), atol=1e-6, rtol=1e-5)
    last = coordinator.published[1].tensors
    assert max(float((last[n] - p.detach()).abs().max()) for n, p in initial.named_parameters()) > 1e-3  # they moved

    for step in range(2):  # each row trained and acked once, then the partition cleared
        assert plane.acked_rows(partition_name("r", step), "r/" + ACTOR_TASK) == [0, 1, 2, 3]
    assert plane.cleared == ["r/train_0", "r/train_1"] and not plane.leases
    assert read_progress(redis, RUN_ID) == TrainerProgress(next_step=2, version=2)
    assert coordinator.finished == [RUN_ID]  # the run's status becomes finished after its last step
    record = trained_steps(redis, RUN_ID)
    assert sorted(record) == [0, 1]
    page = coordinator.steps(RUN_ID)  # each step reported to the coordinator, the last before the run finished
    assert (page.next_step, page.weight_version, coordinator.reported_at_finish) == (2, 2, 2)
    assert [(r.step, r.metrics) for r in page.steps] == [(s, record[s]["metrics"]) for s in (0, 1)]
    assert record[1]["samples"] == ["2:0", "2:1", "3:0", "3:1"]
    assert record[0]["metrics"]["staleness"] == {"0": 4} and record[1]["metrics"]["staleness"] == {"1": 4}
    assert [record[k]["metrics"]["lr"] for k in (0, 1)] == [1e-2, 5e-3]  # the schedule's, step by step
    assert record[1]["metrics"]["version_trained"] == 1 and record[1]["metrics"]["weight_version"] == 2
    membership = session.membership
    assert (membership.steps, membership.versions) == ([0, 1], [1, 2])
    assert (
        status.snapshot()["weight_version"] == 2
        and status.snapshot()["last_metrics"]["loss"] == record[1]["metrics"]["loss"]
    )
    assert coordinator.publishers[0].prefetched == [["engine"], ["engine"]]  # each step's group asked for early
    assert coordinator.publishers[0].closed and membership.closed


def test_a_pause_is_acknowledged_only_after_the_publish_in_flight_lands():
    """The e2e pause test checks progress stands still while paused; this is the rule behind it."""
    from types import SimpleNamespace

    calls = []

    class Membership(FakeMembership):
        def safe_point(self, stop=None, while_paused=None) -> None:
            calls.append("safe_point")

    weights = SimpleNamespace(settle=lambda: calls.append("settle"))
    membership = Membership()
    trainer = SimpleNamespace(leader=lambda: (weights, membership))  # rank 0's (ActorTrainer.leader)
    ActorTrainer.pause_point(trainer, threading.Event())
    assert calls == ["safe_point"]  # running: the publish goes on beside the next step
    calls.clear()
    membership.paused = True
    ActorTrainer.pause_point(trainer, threading.Event())
    assert calls == ["settle", "safe_point"]
