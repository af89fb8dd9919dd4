"""The forward role, on the consumer driver (services/run_state/consumer.py), one step at a time:

    for step N from where the trainer is:
        wait for train_N (colocate: for the whole batch)
        actor_fwd: first take weight versions until it holds step N's proximal version: the one before the
            version step N is trained with (algorithm.proximal_policy previous, held beside the newest one:
            proximal_weights.py), or that version itself (current)
        until train_N is complete for this role:
            take any newly published weights (reference: only versions it is a member for)
            claim a micro batch -> log-probs of the responses -> put log_probs | ref_log_probs -> ack
    after the last step: keep taking published versions until training is done (every receiver gets them)

Published weights are taken in one place, take_weights: before each claim, while waiting for a partition or
a version, and while paused (a sync the trainer began needs every receiver).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

import torch
from prometheus_client import Counter, Gauge

from services.dcs.models import NodeRegistration
from services.dcs.sync.backend_choice import gpu_uuid
from services.dcs.sync.receiver import WeightReceiver
from services.forward.config import ForwardConfig
from services.forward.proximal_weights import ProximalWeights
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import checkpoints
from services.model.response_batch import response_log_probs
from services.model.shared_prompt_batch import build_response_batch
from services.run_contract.partitions import task_name
from services.run_contract.run_config import RunConfig
from services.run_contract.sample_fields import MODEL_INPUTS, writes
from services.run_state.consumer import Consumer, consume_partition, each_step
from services.run_state.seams import Membership, WeightFollower
from services.role.role_service import RoleStatus, serve_role
from services.role.session import RunSession
from services.transferqueue.codec import Batch

log = logging.getLogger(__name__)
ROWS = Counter("sluice_forward_rows_total", "samples whose log-probs were written")
TOKENS = Counter("sluice_forward_tokens_total", "tokens run through the model")
VERSION = Gauge("sluice_forward_weight_version", "weight version held")


class ForwardService:
    """Run by the role host (services/role/role_service.py) with the run's session; `receiver` is the weight
    broadcast's receiving end (services/run_state/seams.py). Tests pass in-memory fakes of both."""

    # the run's, set when the loop starts (start)
    run: RunConfig
    weights: ProximalWeights  # the version it scores with (and, actor_fwd, the one before: proximal_weights.py)
    follower: WeightFollower | None  # None: a role that takes no published weights (reference, ref_update_interval 0)
    scoring_version: int  # actor_fwd: the version the step being consumed is scored with

    def __init__(
        self, config: ForwardConfig, status: RoleStatus, receiver: Callable[..., WeightFollower] = WeightReceiver
    ):
        self.config = config
        self.status = status
        self.make_receiver = receiver
        self.role = config.role
        (self.field,) = writes(config.role)  # log_probs | ref_log_probs

    def run_loop(self, session: RunSession, halt: threading.Event) -> None:
        c, run, tq, steps = self.config, session.run, session.tq, session.steps
        if not (run.uses_actor_fwd if self.role == "actor_fwd" else run.uses_reference):
            # claiming rows nobody reads would only race the trainer's clearing of each partition
            self.status.idle(f"run {run.name} does not use {self.role}")
            log.info("this run does not use this role; idle", extra={"role": self.role})
            halt.wait()
            return
        membership, receiver = self.start(session)
        n = run.group_rows
        micro = c.micro_batch_size or run.micro_batch_size
        micro = max(n, micro - micro % n)  # claims come in whole groups
        tq.register_task(task_name(run.name, self.role), MODEL_INPUTS, group_size=n)
        consumer = Consumer(
            task_name(run.name, self.role),
            micro,
            self.compute,
            "forward",
            done=self.done,
            prepare=lambda: self.keep_current(membership),
            version=lambda: self.follower.version if self.follower is not None else None,
        )
        self.status.running()

        def keep_receiving() -> None:  # while paused: a sync the trainer began before it paused needs every receiver
            if self.take_weights(0.5) is None:
                halt.wait(0.05)

        def pause() -> None:
            membership.safe_point(halt, keep_receiving)

        def keep_up() -> None:  # while waiting for a partition
            pause()
            self.take_weights(0.2)

        def work(step: int, partition: str, behind) -> None:
            if self.role == "actor_fwd":
                self.await_proximal(step, steps, pause, halt)
            consume_partition(tq, partition, consumer, c.lease_s, n, pause, halt, idle=behind)

        try:
            each_step(steps, run.num_steps, halt, pause, work, consumer.task, idle=keep_up)
            # the run's last versions still go to every receiver: keep taking them until training is done
            while (
                self.follower is not None and not halt.is_set() and steps.trainer_progress().next_step < run.num_steps
            ):
                pause()
                self.take_weights(1.0)
        finally:
            receiver.close()
            membership.close()

    def start(self, session: RunSession) -> tuple[Membership, WeightFollower]:
        """The run's model, this role's membership, and its end of the weight broadcast, declared (with the
        version it last loaded, after a restart) when it takes published weights."""
        c, run = self.config, session.run
        self.run = run
        torch.manual_seed(run.optim.seed)
        model, _ = load_causal_lm(run.model, c.dtype, c.device)
        self.weights = ProximalWeights(
            model, 0, keep_previous=self.role == "actor_fwd" and run.algorithm.proximal_policy == "previous"
        )
        self.scoring_version = 0
        membership = session.join(
            NodeRegistration(
                role=self.role,
                host=c.advertise_host,
                ports={"http": c.port},
                device=c.device,
                run_id=c.run_id,
                weights_dtype=c.dtype,
                gpu=gpu_uuid(c.device),
            )
        )
        receiver = self.make_receiver(
            session.dcs, membership.node_id, self.role, c.weight_sync_timeout_s, c.device, run_id=c.run_id
        )
        self.follower = receiver if self.role == "actor_fwd" or run.ref_update_interval > 0 else None
        if self.follower is not None:
            receiver.declare()
            receiver.version = session.dcs.cursors_of(c.run_id, self.role)  # a restarted node waits for the next
            if receiver.version > 0:
                self._catch_up(receiver.version)
        return membership, receiver

    def take_weights(self, wait_s: float) -> int | None:
        """The one place this role takes published weights (follow_weights, into ProximalWeights): the version
        loaded, or None when none came within wait_s (or the role takes none)."""
        if self.follower is None:
            return None
        return self.weights.follow(self.follower, wait_s)

    def await_proximal(self, step: int, steps, pause: Callable[[], None], halt: threading.Event) -> None:
        """actor_fwd: take weight versions until it holds step N's proximal version (algorithm.proximal_policy:
        the one before the version step N trains with, or that one), and score the step with it."""
        needed = step + steps.trainer_progress().version_offset  # the version step N trains with
        if self.weights.previous is not None:
            needed = max(needed - 1, 0)
        self.scoring_version = needed
        while (
            self.follower is not None
            and self.follower.version < needed
            and not halt.is_set()
            and steps.info(step) is not None
        ):
            pause()
            self.take_weights(1.0)

    def _catch_up(self, version: int) -> None:
        """A restarted receiver missed the broadcasts up to `version` (the last one its role loaded):
        load that version from the trainer's checkpoints if one of them holds it (checkpoints are
        written just before their version is published)."""
        found = [c for c in checkpoints(self.config.checkpoint_dir, "actor") if c.version == version]
        if found:
            self.weights.replace(load_causal_lm(found[0].path, self.config.dtype, self.config.device)[0], version)
            log.info(
                "loaded the published weights from a checkpoint", extra={"version": version, "path": found[0].path}
            )
        else:
            log.warning(
                "restarted without the published weights: log-probs use the initial weights until the "
                "next version arrives",
                extra={"version": version},
            )

    def keep_current(self, membership: Membership) -> None:
        """Before each claim: take any newly published weights (reference: only versions it is a member for)."""
        if self.follower is not None:
            self.take_weights(0)
            VERSION.set(self.follower.version)
            membership.progress(weight_version=self.follower.version)

    def compute(self, batch: Batch) -> dict:
        model = self.weights.holding(self.scoring_version)  # the newest unless actor_fwd keeps the one before
        config: Any = model.config  # a transformers model's
        rb = build_response_batch(
            batch["tokens"], batch["prompt_length"], batch["response_length"], hidden_size=config.hidden_size
        )
        log_probs = response_log_probs(model, rb.to_device(self.config.device), self.run.rollout.temperature).cpu()
        TOKENS.inc(rb.token_count)
        return {self.field: rb.to_ragged(log_probs)}

    def done(self, batch: Batch) -> None:
        ROWS.inc(len(batch.rows))
        self.status.update(
            partition=batch.partition, rows_done=self.status.fields.get("rows_done", 0) + len(batch.rows)
        )


async def serve(config: ForwardConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(1)
    status = RoleStatus(config.role)
    await serve_role(config, stop, status, loop=ForwardService(config, status).run_loop)
