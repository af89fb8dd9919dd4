"""The advantage role, on the consumer driver (services/run_state/consumer.py):

    for step N from where the trainer is:
        wait for train_N (colocate: the whole batch)
        until train_N is complete for this task:
            claim whole groups that have every field the estimator needs
            -> compute_advantages(...) (services/algorithms/advantages.py) -> put advantages, returns -> ack

Batch-level normalisation (REINFORCE++ and PPO whitening) is over the groups claimed together: a
whole step in colocate mode, whatever is ready (at most max_groups_per_batch) in fully-async mode.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import torch
from prometheus_client import Counter, Gauge

from services.algorithms.advantages import compute_advantages
from services.algorithms.policy_loss import kl_estimate
from services.advantage.config import AdvantageConfig
from services.dcs.models import NodeRegistration
from services.run_contract.partitions import task_name
from services.run_contract.run_config import RunConfig
from services.run_contract.sample_fields import advantage_inputs, kl_in_reward, policy_log_probs
from services.run_state.consumer import Consumer, consume_partition, each_step
from services.role.role_service import RoleStatus, serve_role
from services.role.session import RunSession
from services.transferqueue.codec import Batch

log = logging.getLogger(__name__)
ROWS = Counter("sluice_advantage_rows_total", "samples whose advantages were written")
ADV_ABS = Gauge("sluice_advantage_abs_mean", "mean |advantage| of the last batch")
TASK = "advantage"


def advantages_of(batch: Batch, run: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] advantages and returns for the rows of `batch` (whole groups, in row order)."""
    algo = run.algorithm
    masks = batch["loss_mask"]
    width = max(1, max(len(m) for m in masks))
    mask = torch.zeros(len(masks), width)
    for i, m in enumerate(masks):
        mask[i, : len(m)] = m

    def padded(name: str) -> torch.Tensor:
        out = torch.zeros(len(masks), width)
        for i, v in enumerate(batch[name]):
            out[i, : len(v)] = v
        return out

    kl = None
    if kl_in_reward(run):
        policy = padded(policy_log_probs(run))
        kl = kl_estimate(policy, padded("ref_log_probs"), algo.kl_kind) * mask
    values = padded("values") if run.uses_critic else None
    return compute_advantages(
        algo.estimator,
        batch["reward"].float(),
        mask,
        run.n_samples_per_prompt,
        values=values,
        kl=kl,
        kl_coef=algo.kl_coef if kl is not None else 0.0,
        gamma=algo.gamma,
        lam=algo.lam,
        copies=run.chains_per_episode,
    )


class AdvantageService:
    """Run by the role host (services/role/role_service.py) with the run's session; tests pass a fake one."""

    def __init__(self, config: AdvantageConfig, status: RoleStatus):
        self.config = config
        self.status = status

    def run_loop(self, session: RunSession, halt: threading.Event) -> None:
        c = self.config
        run, tq = session.run, session.tq
        membership = session.join(
            NodeRegistration(role="advantage", host=c.advertise_host, ports={"http": c.port}, run_id=c.run_id)
        )
        n = run.group_rows
        tq.register_task(task_name(run.name, TASK), advantage_inputs(run), group_size=n)
        # min_rows: answer once a global batch is ready (the trainer claims no less at a time, so waiting for
        # it delays nothing and a step costs one claim, read, put and ack instead of one per few groups), or
        # sooner with whatever is ready when the long poll ends
        rows = (c.max_groups_per_batch or run.rollout_batch_size) * n
        consumer = Consumer(
            task_name(run.name, TASK),
            rows,
            lambda batch: self.compute(batch, run),
            "advantage",
            min_rows=min(rows, run.global_batch_size),
            done=self.done,
        )
        self.status.running()

        def safe_point() -> None:
            membership.safe_point(halt)

        def work(step: int, partition: str, behind) -> None:
            consume_partition(tq, partition, consumer, c.lease_s, n, safe_point, halt, idle=behind)
            membership.progress(step=step)

        try:
            each_step(session.steps, run.num_steps, halt, safe_point, work, consumer.task)
        finally:
            membership.close()

    def compute(self, batch: Batch, run: RunConfig) -> dict:
        advantages, returns = advantages_of(batch, run)
        lengths = [len(m) for m in batch["loss_mask"]]
        ADV_ABS.set(float(advantages.abs().sum()) / max(1, sum(lengths)))
        return {
            "advantages": [advantages[i, :n].contiguous() for i, n in enumerate(lengths)],
            "returns": [returns[i, :n].contiguous() for i, n in enumerate(lengths)],
        }

    def done(self, batch: Batch) -> None:
        ROWS.inc(len(batch.rows))
        self.status.update(
            partition=batch.partition, rows_done=self.status.fields.get("rows_done", 0) + len(batch.rows)
        )


async def serve(config: AdvantageConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(1)
    status = RoleStatus("advantage")
    await serve_role(config, stop, status, loop=AdvantageService(config, status).run_loop)
