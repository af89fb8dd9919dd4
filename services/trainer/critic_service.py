"""The critic (PPO), one step N at a time (N from where the trainer is):

wait for train_N (meanwhile: values for earlier steps' replacements of rows lost with a shard)
write `values` for every row of train_N (the advantage role's GAE needs them)
repeat num_iters_per_train_update times: claim a global batch whose `returns` the advantage role wrote,
    one optimizer step on the value loss, ack the rows
checkpoint when the step is due
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from services.dcs.models import NodeRegistration
from services.run_contract.run_config import RunConfig
from services.model.response_batch import ResponseBatch
from services.run_contract.partitions import partition_name, task_name
from services.run_contract.sample_fields import CRITIC_TRAIN_INPUTS, MODEL_INPUTS
from services.run_state.consumer import Consumer, consume_partition
from services.run_state.step_partitions import StepPartitions, claim_or_done
from services.run_state.seams import DataPlane, Membership
from services.runtime.metrics import gauges
from services.role.role_service import RoleStatus
from services.role.session import RunSession
from services.runtime.spans import span
from services.run_contract.checkpoint import latest_checkpoint, load_optimizer_state, save_checkpoint
from services.trainer.optimizer import adamw, set_lr
from services.trainer.config import TrainerConfig
from services.trainer.precision import autocast, weights_dtype
from services.trainer.critic_update import critic_step, load_critic, response_values
from services.trainer.tasks import CRITIC_TRAIN_TASK, CRITIC_VALUES_TASK, claim_global_batch, read_or_give_back

log = logging.getLogger(__name__)


@dataclass
class OnRun:
    """What the critic works with on its run."""

    run: RunConfig
    tq: DataPlane
    steps: StepPartitions
    critic: torch.nn.Module
    optimizer: torch.optim.Optimizer
    membership: Membership
    halt: threading.Event

    def safe_point(self) -> None:
        self.membership.safe_point(self.halt)

    def task(self, name: str) -> str:
        return task_name(self.run.name, name)


class CriticTrainer:
    """Run by the role host (services/role/role_service.py) with the run's session; tests pass a fake one."""

    def __init__(self, config: TrainerConfig, status: RoleStatus):
        self.config = config
        self.status = status
        self.gauges = gauges(
            "sluice_critic",
            {
                "value_loss": "value loss of the last optimizer step",
                "value_clip_fraction": "fraction of tokens whose value was clipped",
                "grad_norm": "gradient norm before clipping",
                "step": "last step trained",
            },
        )

    def run_loop(self, session: RunSession, halt: threading.Event) -> None:
        run = session.run
        if not run.uses_critic:
            self.status.idle(f"run {run.name} does not use a critic (estimator {run.algorithm.estimator})")
            log.info("this run does not use a critic; idle")
            halt.wait()
            return
        on = self.start(session, halt)
        self.status.running()
        try:
            step = on.steps.first_step()
            while step < run.num_steps and not halt.is_set():
                on.safe_point()
                waiting = functools.partial(self.waiting, on, step)
                if on.steps.wait_for(step, halt, waiting):
                    self.train_step(on, step, waiting)
                    on.membership.progress(step=step)
                step += 1
        finally:
            on.membership.close()

    def start(self, session: RunSession, halt: threading.Event) -> OnRun:
        """The critic from its checkpoint (or the run's model), its optimizer, its membership and its tasks."""
        c, run = self.config, session.run
        torch.manual_seed(run.optim.seed)
        ckpt = latest_checkpoint(c.checkpoint_dir, "critic") if c.checkpoint_dir else None
        critic = load_critic(ckpt.path if ckpt else run.model, getattr(torch, weights_dtype(c.precision))).to(c.device)
        optimizer = adamw(critic.parameters(), run.optim.critic_lr, run.optim.betas, run.optim.weight_decay, c.device)
        if ckpt:
            load_optimizer_state(ckpt.path, optimizer)
        membership = session.join(
            NodeRegistration(
                role="critic", host=c.advertise_host, ports={"http": c.port}, device=c.device, run_id=c.run_id
            )
        )
        on = OnRun(run, session.tq, session.steps, critic, optimizer, membership, halt)
        on.tq.register_task(on.task(CRITIC_VALUES_TASK), MODEL_INPUTS, group_size=run.group_rows)
        on.tq.register_task(on.task(CRITIC_TRAIN_TASK), CRITIC_TRAIN_INPUTS, group_size=run.group_rows)
        return on

    def waiting(self, on: OnRun, step: int) -> None:
        """While a claim or the next partition keeps it waiting: a safe point, and earlier steps' lost rows."""
        on.safe_point()
        self.catch_up(on, step)

    def train_step(self, on: OnRun, step: int, waiting: Callable[[], None]) -> None:
        """Step N: values for every row, then num_iters_per_train_update optimizer steps on the returns, then its
        checkpoint if due."""
        run, partition = on.run, partition_name(on.run.name, step)
        assert run.num_iters_per_train_update is not None  # RunConfig's validation sets it
        self.write_values(on, partition, idle=waiting)
        for _ in range(run.num_iters_per_train_update):
            claimed, batch = self.claimed_batch(on, partition, step, waiting)
            if claimed is None:
                break
            set_lr(on.optimizer, run.optim.critic_lr, step, run.optim, run.num_steps)
            with span("train", step):
                m = critic_step(
                    on.critic,
                    on.optimizer,
                    batch,
                    run,
                    run.micro_batch_size,
                    self.config.device,
                    precision=self.config.precision,
                )
            on.tq.ack(claimed.lease_id)
            self.report(step, m)
        if self.config.checkpoint_dir and run.checkpoint.due_after(step):
            save_checkpoint(
                self.config.checkpoint_dir,
                "critic",
                on.critic,
                on.optimizer,
                run.model,
                step + 1,
                0,
                keep=run.checkpoint.keep_last,
            )

    def report(self, step: int, m) -> None:
        self.status.update(step=step, value_loss=m.loss)
        self.gauges["value_loss"].set(m.loss)
        self.gauges["value_clip_fraction"].set(m.means().get("value_clip_fraction", 0.0))
        self.gauges["grad_norm"].set(m.grad_norm)
        self.gauges["step"].set(step)

    def claimed_batch(self, on: OnRun, partition: str, step: int, idle: Callable[[], None]):
        """(claimed, batch) of one global batch, claimed again when rows of it were lost with their shard;
        (None, None) when halted or the partition ran out. `idle` runs between claims that found too little."""
        while True:
            with span("claim", step):
                claimed = claim_global_batch(
                    on.tq,
                    partition,
                    on.task(CRITIC_TRAIN_TASK),
                    on.run.global_batch_size,
                    self.config.lease_s,
                    on.halt,
                    idle,
                    short_ok=True,
                )
            if claimed is None:
                return None, None
            batch = read_or_give_back(on.tq, claimed, CRITIC_TRAIN_INPUTS)
            if batch is not None:
                return claimed, batch

    def catch_up(self, on: OnRun, step: int) -> None:
        """Steps up to `step` whose rows were lost with a storage shard after this critic wrote their values
        (StepPartitions.reopened): values for the replacements, which the advantage role needs. A step before
        `step` the critic has trained, on the rows that were lost; the replacements' critic_train rows are
        acked untrained there (they replace samples the actor had not consumed, and the actor trains them)."""
        for earlier in on.steps.reopened(step + 1, on.task(CRITIC_VALUES_TASK)):
            partition = partition_name(on.run.name, earlier)
            self.write_values(on, partition)
            while earlier < step and not on.halt.is_set():
                batch = claim_or_done(
                    on.tq, partition, on.task(CRITIC_TRAIN_TASK), on.run.global_batch_size, self.config.lease_s
                )
                if batch is None:
                    break
                if batch.rows:
                    on.tq.ack(batch)

    def write_values(self, on: OnRun, partition: str, idle: Callable[[], None] = lambda: None) -> None:
        """`values` for every row of the partition (the advantage role's GAE needs them); `idle` runs
        while no row is ready."""
        n = on.run.group_rows

        def values(batch) -> dict:
            rb = ResponseBatch.build(batch["tokens"], batch["prompt_length"], batch["response_length"])
            with torch.no_grad(), autocast(self.config.precision, self.config.device):  # as it trains
                on.critic.eval()
                out = response_values(on.critic, rb.to_device(self.config.device)).cpu() * rb.mask
            return {"values": rb.to_ragged(out)}

        consumer = Consumer(on.task(CRITIC_VALUES_TASK), max(n, on.run.micro_batch_size // n * n), values, "values")
        consume_partition(on.tq, partition, consumer, self.config.lease_s, n, on.safe_point, on.halt, idle=idle)
