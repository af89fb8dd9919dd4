"""The trainer role's loops.

Actor, one step N at a time (N from the checkpoint / progress, see resumption.py):

    wait for train_N (colocate: the whole batch)
    repeat num_iters_per_train_update times:
        claim a global batch of actor_train rows (waiting while the partition fills)
        check each sample's staleness (version now - version its generation began under)
        micro batches -> PPO-style loss -> backward; clip; optimizer step; ack the rows
    version += 1; on a worker thread, while the loop claims and trains step N+1: publish a copy of the
        weights through DCS (engines, actor_fwd, reference on its interval) and record progress (next step,
        version); a step due for a checkpoint is checkpointed there too, from a copy of the weights and
        optimizer state (services/trainer/checkpoint_copy.py; over --snapshot-publish-mb, from the live ones,
        and step N+1's optimizer waits for it: services/trainer/publishing.py); a sharded backend (fsdp,
        megatron) publishes here instead, its weights gathered from every rank a bucket at a time
    clear train_N once every task consumed it (on another worker thread)

This module holds the schedule; each rank's share of a global batch is claimed in batch_claims.py, a step's
metrics are tallied in step_tally.py and the checkpoints written by actor_checkpoints.py. The critic (PPO) is
services/trainer/critic_service.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Callable

import torch

from services.dcs.client import DCSError
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import WeightPublisher
from services.run_contract.partitions import partition_name, task_name
from services.run_contract.sample_fields import actor_inputs
from services.run_state.seams import Membership, WeightSender
from services.run_state.trainer_progress import TrainerProgress, finish_step
from services.runtime.metrics import gauges
from services.role.role_service import RoleStatus, serve_role
from services.role.session import RunSession
from services.runtime.spans import span
from services.trainer.actor_checkpoints import ActorCheckpoints
from services.trainer.actor_update import loss_totals
from services.run_contract.checkpoint import CheckpointState, latest_checkpoint
from services.trainer.batch_claims import GlobalBatchClaims
from services.trainer.config import TrainerConfig
from services.trainer.backend import live_weights_of, make_backend
from services.trainer.lora import load_actor
from services.trainer.data_parallel import DataParallel, Order, process_group_backend
from services.trainer.device import DeviceClock, MicroBatchSizer, allow_tf32
from services.trainer.critic_service import CriticTrainer
from services.trainer.optimizer import set_lr
from services.trainer.partition_clearing import PartitionClearing
from services.trainer.precision import weights_dtype
from services.trainer.checkpoint_copy import TrainingStateCopy, copy_if_affordable
from services.trainer.publishing import WeightVersions
from services.trainer.resumption import resume_position
from services.trainer.staleness import staleness_histogram
from services.trainer.step_tally import StepTally
from services.trainer.tasks import ACTOR_TASK
from services.trainer.tracking_hook import NO_TRACKING, Tracker, open_training_tracker

log = logging.getLogger(__name__)
ACTOR_GAUGES = {
    "loss": "loss of the last step",
    "clip_fraction": "PPO clip fraction",
    "kl": "KL to the reference",
    "entropy": "policy entropy",
    "grad_norm": "gradient norm before clipping",
    "reward_mean": "mean reward",
    "rollout_logprob_abs_diff": "mean |train - rollout| log-prob of the same tokens",
    "tokens_per_s": "trained tokens per second of compute",
    "wait_s": "seconds waiting for data in the last step",
    "step": "last finished step",
    "weight_version": "weight version published",
}


class ActorTrainer:
    """Run by the role host (services/role/role_service.py) with the run's session; `publisher` is the weight
    broadcast's sending end (services/run_state/seams.py). Tests pass in-memory fakes of both."""

    def __init__(
        self, config: TrainerConfig, status: RoleStatus, publisher: Callable[..., WeightSender] = WeightPublisher
    ):
        self.config, self.status = config, status
        self.make_publisher = publisher
        self.version = 0
        self.weights: WeightVersions | None = None  # on the leader once it runs
        self.gauges = gauges("sluice_trainer", ACTOR_GAUGES)
        self.staleness = staleness_histogram()
        self.tracking: Tracker = NO_TRACKING  # rank 0's experiment tracking (services/trainer/tracking_hook.py)
        self.halted_mid_step = False  # an unfinished step's optimizer steps moved the weights

    def run_loop(self, session: RunSession, halt: threading.Event) -> None:
        """The role's schedule: the actor and its backend (from the latest checkpoint); rank 0 joins the run, to
        publish the weights and report; the run's task registered; then rank 0 leads the steps and the other
        ranks follow it."""
        c = self.config
        self.dcs, self.run, self.tq, self.redis = session.dcs, session.run, session.tq, session.redis
        self.steps = session.steps
        self.clearing = PartitionClearing(self.tq, self.steps, self.run, c.clear_wait_s)
        torch.manual_seed(self.run.optim.seed)
        ckpt = latest_checkpoint(c.checkpoint_dir, "actor") if c.checkpoint_dir else None
        self.build_actor(ckpt)
        self.membership: Membership | None = None
        if self.dp.is_leader:  # the other ranks follow it through the group, not the coordinator
            self.join_run(session)
        self.actor_task = task_name(self.run.name, ACTOR_TASK)  # the run's own task
        self.tq.register_task(self.actor_task, actor_inputs(self.run), group_size=self.run.group_rows)
        self.claims = GlobalBatchClaims(self.tq, self.run, self.actor_task, c.lease_s, self.dp, self.backend, self)
        try:
            if self.dp.is_leader:
                self.lead(ckpt, halt)
            else:
                self.follow(halt)
        finally:
            self.clearing.close()
            if self.weights is not None:
                self.weights.close()
            self.tracking.close()  # after the last publish, whose step it tracks
            if self.membership is not None:
                self.membership.close()
            self.dp.close()

    def build_actor(self, ckpt: CheckpointState | None) -> None:
        """The actor model (the checkpoint's weights, else the run's model), this rank's data-parallel group,
        the backend that trains it and its optimizer (the checkpoint's state)."""
        c, run = self.config, self.run
        self.model = load_actor(run, ckpt.path if ckpt else None, weights_dtype(c.precision), c.device)
        self.dp = DataParallel(c.dp_rank, c.dp_size, c.dp_master, backend=process_group_backend(c.device))
        self.backend = make_backend(
            c.backend,
            self.model,
            run,
            c.device,
            self.dp,
            param_dtype=c.fsdp_param_dtype,
            cpu_offload=c.fsdp_cpu_offload,
            tp=c.tp_size,
            pp=c.pp_size,
            sequence_parallel=c.sequence_parallel,
            precision=c.precision,
        )
        self.optimizer = self.backend.optimizer
        self.sizer = MicroBatchSizer(c.device, c.auto_micro_batch, self.model)
        self.checkpoints = ActorCheckpoints(c, run, self.model, self.optimizer, self.backend, self.dp)
        if ckpt:
            self.backend.load_optimizer(ckpt.path)

    def join_run(self, session: RunSession) -> None:
        """Rank 0's part in the run: its membership, the weight publisher with the versions it publishes, and the
        run's experiment tracking."""
        c = self.config
        self.membership = session.join(
            NodeRegistration(
                role="trainer",
                host=c.advertise_host,
                ports={"http": c.port},
                device=c.device,
                run_id=c.run_id,
                parallel={"dp": c.dp_size},
            )
        )
        sender = self.make_publisher(
            self.dcs,
            self.membership.node_id,
            c.master_address,
            bucket_bytes=c.bucket_mb << 20,
            timeout_s=c.weight_sync_timeout_s,
            pause_mode=c.pause_mode,
            run_id=c.run_id,
            backend=c.sync_backend,
            device=c.device,
            adapter_dir=c.adapter_files_dir,
        )
        source = self.weight_stream if self.backend.gathers else live_weights_of(self.backend)  # lora: adapter
        self.weights = WeightVersions(
            sender,
            self.model,
            self.run,
            self.dcs,
            c.run_id,
            c.republish_check_s,
            snapshot_max_bytes=c.snapshot_publish_mb << 20,
            source=source,
        )
        self.tracking = open_training_tracker(self.run, c.output_dir, c.run_id, self.redis, self.dcs)

    def pause_point(self, halt: threading.Event) -> None:
        """A pause is acknowledged with nothing in flight: the last step's publish and record land first (the
        engines keep taking part in syncs while paused), so a paused run's progress stands still."""
        weights, membership = self.leader()
        if membership.paused:
            weights.settle()
        membership.safe_point(halt)

    def leader(self) -> tuple[WeightVersions, Membership]:
        """Rank 0's weight versions and membership in the run: the other ranks neither publish nor report."""
        if self.weights is None or self.membership is None:
            raise RuntimeError(f"data-parallel rank {self.dp.rank} is not the leader: it neither publishes nor reports")
        return self.weights, self.membership

    def lead(self, ckpt, halt: threading.Event) -> None:
        run, weights = self.run, self.leader()[0]
        step, self.version = resume_position(self, ckpt)
        self.checkpoints.checkpointed = step
        self.status.running()
        while step < run.num_steps and not halt.is_set():
            self.pause_point(halt)
            with span("claim", step, self.version):
                if not self.steps.wait_for(step, halt, lambda: self.waiting(step, halt)):
                    continue
            self.dp.order(Order.TRAIN, step, self.version)
            trained = self.train_step(step, halt)
            if trained is None:  # halted mid-step: the rows go back to the queue on restart
                break
            ids, metrics = trained
            state, copied = self.checkpoints.sharded_state(step), None
            if self.checkpoints.due(step) and not self.backend.gathers:
                copied = copy_if_affordable(self.model, self.optimizer, self.config.snapshot_publish_mb << 20)
            then = functools.partial(self.finish, step, ids=ids, metrics=metrics, state=state, copied=copied, halt=halt)
            weights.settle()  # the last publish: its version numbers this one
            if self.backend.gathers:  # streamed from every rank's shards, here, with the other ranks
                weights.publish_now(step, self.version + 1, then)
            else:
                # published and recorded on a worker thread while the next step's rows are claimed and trained
                # (from a copy of the weights; with the optimizer state when checkpointed: checkpoint_copy.py); a
                # checkpoint too large to copy is written from the live weights, which train_step lets settle
                # before the optimizer moves them again
                weights.publish_later(
                    step,
                    self.version + 1,
                    then,
                    weights=copied.weights if copied else None,
                    snapshot=weights.snapshot_fits and not self.checkpoints.due(step),
                )
            self.clearing.later(step, halt, recorded=weights.pending)
            step += 1
        weights.settle()
        self.clearing.later(None, halt)  # the last partition is cleared (or its failure raised) before the loop ends
        self.checkpoints.final(step, self.version, self.halted_mid_step, halt)
        if not halt.is_set():
            self.dp.order(Order.STOP, step, self.version)  # the other ranks are done too
            try:
                self.dcs.finish_run(self.config.run_id)  # the run's status: finished
            except DCSError as exc:  # stopped (or failed) meanwhile: it keeps that status
                log.warning("the run ended before it finished", extra={"error": str(exc)})

    def weight_stream(self):
        """The leader's source of a publish from a sharded backend: the other ranks are told to make the same
        stream (they gather with it and keep nothing)."""
        self.dp.order(Order.GATHER, 0, self.version)
        return self.backend.weight_stream()

    def finish(
        self,
        step: int,
        version: int,
        ids: list[str],
        metrics: dict,
        state=None,
        copied: TrainingStateCopy | None = None,
        halt: threading.Event | None = None,
    ) -> None:
        """Step N is published as `version`: its audit record and the progress past it, its checkpoint if due, then
        its report. The checkpoint follows the record: a process killed between the two resumes past the recorded
        step with the older weights (resumption.py); no trained step goes unrecorded. The last step first waits
        for the run's engines to serve its weights (WeightVersions.catch_up_engines)."""
        c, weights = self.config, self.leader()[0]
        self.version = version
        if step == self.run.num_steps - 1:  # before the record, while the rollout keeps its engines registered
            weights.catch_up_engines(version, c.final_sync_wait_s, halt)
        metrics.update(
            weight_version=version, publish_s=weights.last_publish_s, publish_bytes=weights.last_publish_bytes
        )
        finish_step(self.redis, c.run_id, step, ids, metrics, TrainerProgress(next_step=step + 1, version=version))
        if self.checkpoints.due(step):
            self.checkpoints.write(step + 1, version, state, copied)
        self.report(step, metrics)
        self.tracking.step_finished(step, metrics)

    def follow(self, halt: threading.Event) -> None:
        """A data-parallel rank other than 0: train each step the leader starts, on its share."""
        self.status.running()
        while not halt.is_set():
            order, step, self.version = self.dp.next_order()
            if order == Order.STOP:
                return
            if order == Order.CHECKPOINT:
                self.backend.write_checkpoint_files(self.checkpoints.scratch(step))
                continue
            if order == Order.GATHER:  # only a gathering backend is told to: its stream is made, then closed
                stream = self.backend.weight_stream()
                if stream is not None:
                    stream.close()
                continue
            if self.train_step(step, halt) is None:
                return
            self.checkpoints.sharded_state(step)
            self.status.update(step=step)

    # ------------------------------------------------------------------ one step

    def waiting(self, step: int, halt: threading.Event) -> None:
        """Runs while the trainer waits for data: a pause safe point, and the check for engines serving
        older weights than the published version (WeightVersions.resend_if_lagging)."""
        self.pause_point(halt)
        self.leader()[0].resend_if_lagging(self.version)

    def train_step(self, step: int, halt: threading.Event):
        """Train step N: num_iters_per_train_update global batches, each split across the ranks.
        Returns (trained sample ids, metrics) on the leader, (None, None) elsewhere; None if halted."""
        run, c, dp = self.run, self.config, self.dp
        tally = StepTally(self.staleness)
        clock = DeviceClock(c.device)  # compute_s waits for the GPU's kernels; the step's peak GPU memory
        nonce = self.claims.nonce()  # claim keys: the ranks claim the same rows
        for it in range(run.iters_per_step):
            t0 = time.perf_counter()
            claimed, batch = self.claims.claimed_batch(step, nonce, it, halt)
            tally.wait_s += time.perf_counter() - t0
            if claimed is None:
                self.halted_mid_step = it > 0
                if halt.is_set() or not dp.is_leader:
                    return None
                raise RuntimeError(
                    f"{partition_name(run.name, step)} ran out of rows before {run.rows_per_step} were trained"
                )
            info, batch = self.claims.my_share(step, claimed, batch)
            version = self._policy_version(it)
            lr = set_lr(self.optimizer, run.optim.lr, step, run.optim, run.num_steps)  # run.optim.lr_schedule
            t1 = time.perf_counter()
            tokens, seqs = loss_totals(batch, run, dp, self.backend.data_size)
            with span("train", step, version):
                m = self.backend.train(
                    batch, run, self.sizer.rows(run.micro_batch_size, batch), c.device, totals=(tokens, seqs)
                )
            tally.compute_s += clock.since(t1)
            if not dp.is_leader:
                continue
            self.tq.ack(claimed.lease_id)
            tally.add(info, m, tokens, version, self.leader()[0].lag)
            self.tracking.offer_samples(step, batch)
        if not dp.is_leader:
            return None, None
        return tally.ids, tally.metrics(
            step, run.max_staleness, version_trained=version, dp_size=dp.size, lr=lr, **self.sizer.observe(clock)
        )

    def _policy_version(self, it: int) -> int:
        """The version iteration `it`'s samples are trained at (the one in flight, if a publish is), once the
        weights it moves may change; the last iteration also asks for the sync group its step will publish in."""
        if not self.dp.is_leader:
            return self.version
        return self.leader()[0].training_version(self.version, it == self.run.iters_per_step - 1)

    def report(self, step: int, metrics: dict) -> None:
        for name, gauge in self.gauges.items():
            value = step if name == "step" else metrics.get(name)
            if isinstance(value, (int, float)):
                gauge.set(value)
        self.leader()[1].progress(step=step, weight_version=metrics["weight_version"])
        self.status.update(step=step, weight_version=metrics["weight_version"], last_metrics=metrics)
        log.info("step finished", extra={"step": step, "metrics": metrics})


async def serve(config: TrainerConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(1)
    allow_tf32(config.device, config.tf32)  # the actor's and the critic's float32 matmuls (CUDA only)
    status = RoleStatus("trainer" if config.role == "actor" else "critic")
    trainer = ActorTrainer(config, status) if config.role == "actor" else CriticTrainer(config, status)
    await serve_role(config, stop, status, loop=trainer.run_loop)
