"""The critic (PPO): per step, write `values` for every row, then train on `returns` once the advantage
role has written them."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch
from services.dcs.models import NodeRegistration
from services.run_contract.run_config import RunConfig
from services.model.response_batch import ResponseBatch
from services.run_contract.partitions import partition_name, task_name
from services.run_contract.sample_fields import CRITIC_TRAIN_INPUTS, MODEL_INPUTS
from services.run_state.consumer import Consumer, consume_partition
from services.run_state.step_partitions import claim_or_done
from services.run_state.seams import DataPlane
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


class CriticTrainer:
    """Run by the role host (services/role/role_service.py) with the run's session; tests pass a fake one."""

    def __init__(self, config: TrainerConfig, status: RoleStatus):
        self.config = config
        self.status = status
        self.gauges = gauges("sluice_critic", {"value_loss": "value loss of the last optimizer step",
                                                "value_clip_fraction": "fraction of tokens whose value was clipped",
                                                "grad_norm": "gradient norm before clipping",
                                                "step": "last step trained"})

    def run_loop(self, session: RunSession, halt: threading.Event) -> None:
        c = self.config
        run, tq, steps = session.run, session.tq, session.steps
        if not run.uses_critic:
            self.status.idle(f"run {run.name} does not use a critic (estimator {run.algorithm.estimator})")
            log.info("this run does not use a critic; idle")
            halt.wait()
            return
        torch.manual_seed(run.optim.seed)
        ckpt = latest_checkpoint(c.checkpoint_dir, "critic") if c.checkpoint_dir else None
        critic = load_critic(ckpt.path if ckpt else run.model, getattr(torch, weights_dtype(c.precision))).to(c.device)
        optimizer = adamw(critic.parameters(), run.optim.critic_lr, run.optim.betas, run.optim.weight_decay,
                          c.device)
        if ckpt:
            load_optimizer_state(ckpt.path, optimizer)
        membership = session.join(NodeRegistration(role="critic", host=c.advertise_host, ports={"http": c.port},
                                                   device=c.device, run_id=c.run_id))
        n = run.group_rows
        assert run.num_iters_per_train_update is not None  # RunConfig's validation sets it
        tq.register_task(task_name(run.name, CRITIC_VALUES_TASK), MODEL_INPUTS, group_size=n)
        tq.register_task(task_name(run.name, CRITIC_TRAIN_TASK), CRITIC_TRAIN_INPUTS, group_size=n)
        self.status.running()
        try:
            step = steps.first_step()

            def waiting() -> None:  # while a claim or the next partition keeps it waiting
                membership.safe_point(halt)
                self.catch_up(tq, steps, critic, run, membership, halt, step)
            while step < run.num_steps and not halt.is_set():
                membership.safe_point(halt)
                if steps.wait_for(step, halt, waiting):
                    partition = partition_name(run.name, step)
                    self.write_values(tq, critic, partition, run, membership, halt, idle=waiting)
                    for _ in range(run.num_iters_per_train_update):
                        claimed, batch = self.claimed_batch(tq, partition, step, run, halt, waiting)
                        if claimed is None:
                            break
                        set_lr(optimizer, run.optim.critic_lr, step, run.optim, run.num_steps)
                        with span("train", step):
                            m = critic_step(critic, optimizer, batch, run, run.micro_batch_size, c.device,
                                            precision=c.precision)
                        tq.ack(claimed.lease_id)
                        self.status.update(step=step, value_loss=m.loss)
                        means = m.means()
                        self.gauges["value_loss"].set(m.loss)
                        self.gauges["value_clip_fraction"].set(means.get("value_clip_fraction", 0.0))
                        self.gauges["grad_norm"].set(m.grad_norm)
                        self.gauges["step"].set(step)
                    if c.checkpoint_dir and run.checkpoint.interval and (step + 1) % run.checkpoint.interval == 0:
                        save_checkpoint(c.checkpoint_dir, "critic", critic, optimizer, run.model, step + 1, 0,
                                        keep=run.checkpoint.keep_last)
                    membership.progress(step=step)
                step += 1
        finally:
            membership.close()

    def claimed_batch(self, tq: DataPlane, partition: str, step: int, run: RunConfig, halt,
                      idle: Callable[[], None]):
        """(claimed, batch) of one global batch, claimed again when rows of it were lost with their shard;
        (None, None) when halted or the partition ran out. `idle` runs between claims that found too little."""
        while True:
            with span("claim", step):
                claimed = claim_global_batch(tq, partition, task_name(run.name, CRITIC_TRAIN_TASK),
                                             run.global_batch_size, self.config.lease_s, halt, idle,
                                             short_ok=True)
            if claimed is None:
                return None, None
            batch = read_or_give_back(tq, claimed, CRITIC_TRAIN_INPUTS)
            if batch is not None:
                return claimed, batch

    def catch_up(self, tq: DataPlane, steps, critic, run: RunConfig, membership, halt, step: int) -> None:
        """Steps up to `step` whose rows were lost with a storage shard after this critic wrote their values
        (StepPartitions.reopened): values for the replacements, which the advantage role needs. A step before
        `step` the critic has trained, on the rows that were lost; the replacements' critic_train rows are
        acked untrained there (they replace samples the actor had not consumed, and the actor trains them)."""
        for earlier in steps.reopened(step + 1, task_name(run.name, CRITIC_VALUES_TASK)):
            partition = partition_name(run.name, earlier)
            self.write_values(tq, critic, partition, run, membership, halt)
            while earlier < step and not halt.is_set():
                batch = claim_or_done(tq, partition, task_name(run.name, CRITIC_TRAIN_TASK), run.global_batch_size,
                                      self.config.lease_s)
                if batch is None:
                    break
                if batch.rows:
                    tq.ack(batch)

    def write_values(self, tq: DataPlane, critic, partition: str, run: RunConfig, membership, halt,
                     idle: Callable[[], None] = lambda: None) -> None:
        """`values` for every row of the partition (the advantage role's GAE needs them); `idle` runs
        while no row is ready."""
        n = run.group_rows

        def values(batch) -> dict:
            rb = ResponseBatch.build(batch["tokens"], batch["prompt_length"], batch["response_length"])
            with torch.no_grad(), autocast(self.config.precision, self.config.device):  # as it trains
                critic.eval()
                out = response_values(critic, rb.to_device(self.config.device)).cpu() * rb.mask
            return {"values": rb.to_ragged(out)}
        consumer = Consumer(task_name(run.name, CRITIC_VALUES_TASK), max(n, run.micro_batch_size // n * n), values,
                            "values")
        consume_partition(tq, partition, consumer, self.config.lease_s, n, lambda: membership.safe_point(halt), halt,
                          idle=idle)
