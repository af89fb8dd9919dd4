"""The forward role's loop, one step at a time:

    for step N from where the trainer is:
        wait for train_N (colocate: for the whole batch)
        actor_fwd: first take weight versions until it holds the one step N is trained with
        until train_N is complete for this role:
            take any newly published weights (reference: only versions it is a member for)
            claim a micro batch -> log-probs of the responses -> put log_probs | ref_log_probs -> ack
"""

from __future__ import annotations

import asyncio
import logging
import threading

import torch
from prometheus_client import Counter, Gauge

from services.dcs.membership import RunMembership
from services.dcs.models import NodeRegistration
from services.dcs.sync.receiver import WeightReceiver, follow_weights
from services.forward.config import ForwardConfig
from services.model.loading import load_causal_lm
from services.runtime.spans import span
from services.run_contract.checkpoint import checkpoints
from services.model.response_batch import ResponseBatch, response_log_probs
from services.run_contract.partitions import SAMPLE_FIELDS, partition_name, step_of
from services.run_state.connections import RunConnections
from services.run_state.step_partitions import claim_or_done, put_once
from services.runtime.role_service import RoleStatus, serve_role
from services.transferqueue.client.queue import TransferQueue

log = logging.getLogger(__name__)
ROWS = Counter("sluice_forward_rows_total", "samples whose log-probs were written")
TOKENS = Counter("sluice_forward_tokens_total", "tokens run through the model")
VERSION = Gauge("sluice_forward_weight_version", "weight version held")

OUTPUT_FIELD = {"actor_fwd": "log_probs", "reference": "ref_log_probs"}


class ForwardService:
    def __init__(self, config: ForwardConfig, status: RoleStatus):
        self.config = config
        self.status = status
        self.role = config.role
        self.field = OUTPUT_FIELD[config.role]

    def run_loop(self, halt: threading.Event) -> None:
        c = self.config
        conn = RunConnections.open(c, halt)
        if conn is None:
            return
        self.run = run = conn.run
        tq, steps = conn.tq, conn.steps
        if not (run.uses_actor_fwd if self.role == "actor_fwd" else run.uses_reference):
            # claiming rows nobody reads would only race the trainer's clearing of each partition
            self.status.idle(f"run {run.name} does not use {self.role}")
            log.info("this run does not use this role; idle", extra={"role": self.role})
            conn.close()
            halt.wait()
            return
        torch.manual_seed(run.optim.seed)
        self.model, _ = load_causal_lm(run.model, c.dtype, c.device)
        membership = RunMembership(conn.dcs, NodeRegistration(role=self.role, host=c.advertise_host,
                                                              ports={"http": c.port}, device=c.device, run_id=c.run_id))
        receives = self.role == "actor_fwd" or run.ref_update_interval > 0
        receiver = WeightReceiver(conn.dcs, membership.node_id, self.role, c.weight_sync_timeout_s, c.device)
        pause = self._pause_point(membership, receiver if receives else None, halt)

        def keep_up() -> None:  # while waiting for a partition: pause point, and take weights meanwhile
            pause()
            if receives:
                follow_weights(receiver, self.model, wait_s=0.2)
        if receives:
            receiver.declare()
            receiver.version = conn.dcs.cursors_of(self.role)  # a restarted node waits for the next version
            if receiver.version > 0:
                self._catch_up(receiver.version)
        micro = c.micro_batch_size or run.micro_batch_size
        n = run.n_samples_per_prompt
        micro = max(n, micro - micro % n)  # claims come in whole groups
        tq.register_task(self.role, SAMPLE_FIELDS, group_size=n)
        self.status.running()
        try:
            step = steps.first_step()
            while step < run.num_steps and not halt.is_set():
                pause()
                if not steps.wait_for(step, halt, keep_up):
                    step += 1
                    continue
                if self.role == "actor_fwd":  # log-probs of step N come from the weights step N trains with
                    needed = step + steps.trainer_progress().version_offset
                    while receiver.version < needed and not halt.is_set() and steps.info(step) is not None:
                        pause()
                        follow_weights(receiver, self.model, wait_s=1.0)
                self._consume(tq, partition_name(step), micro, receiver if receives else None, membership, pause, halt)
                step += 1
            # the run's last versions still go to every receiver: keep taking them until training is done
            while receives and not halt.is_set() and steps.trainer_progress().next_step < run.num_steps:
                pause()
                follow_weights(receiver, self.model, wait_s=1.0)
        finally:
            receiver.close()
            membership.close()
            conn.close()

    def _catch_up(self, version: int) -> None:
        """A restarted receiver missed the broadcasts up to `version` (the last one its role loaded):
        load that version from the trainer's checkpoints if one of them holds it (checkpoints are
        written just before their version is published)."""
        found = [c for c in checkpoints(self.config.checkpoint_dir, "actor") if c.version == version]
        if found:
            self.model, _ = load_causal_lm(found[0].path, self.config.dtype, self.config.device)
            log.info("loaded the published weights from a checkpoint", extra={"version": version,
                                                                               "path": found[0].path})
        else:
            log.warning("restarted without the published weights: log-probs use the initial weights until the "
                        "next version arrives", extra={"version": version})

    def _pause_point(self, membership: RunMembership, receiver, halt):
        """A pause safe point that keeps receiving weights: a sync the trainer began before it paused
        needs every receiver."""
        def keep_receiving() -> None:
            if receiver is None or follow_weights(receiver, self.model, wait_s=0.5) is None:
                halt.wait(0.05)
        return lambda: membership.safe_point(halt, keep_receiving)

    def _consume(self, tq: TransferQueue, partition: str, micro: int, receiver, membership, pause, halt) -> None:
        while not halt.is_set():
            pause()
            if receiver is not None:
                follow_weights(receiver, self.model, wait_s=0)
                VERSION.set(receiver.version)
                membership.progress(weight_version=receiver.version)
            step, version = step_of(partition), receiver.version if receiver is not None else None
            with span("claim", step, version):
                batch = claim_or_done(tq, partition, self.role, micro, self.config.lease_s)
            if batch is None:
                return
            if not batch.rows:
                continue
            with span("forward", step, version):
                rb = ResponseBatch.build(batch["tokens"], batch["prompt_length"], batch["response_length"])
                log_probs = response_log_probs(self.model, rb.to_device(self.config.device),
                                               self.run.rollout.temperature).cpu()
            with span("put", step, version):
                put_once(tq, partition, {self.field: rb.to_ragged(log_probs)}, batch.rows,
                         self.run.n_samples_per_prompt)
            tq.ack(batch)
            ROWS.inc(len(batch.rows))
            TOKENS.inc(int(rb.attention_mask.sum()))
            self.status.update(partition=partition, rows_done=self.status.fields.get("rows_done", 0) + len(batch.rows))


async def serve(config: ForwardConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(1)
    status = RoleStatus(config.role)
    await serve_role(config, stop, status, loop=ForwardService(config, status).run_loop)
