"""Where a restarted actor trainer continues: its checkpoint, the run's progress record and the coordinator's
latest published version, reconciled (the functions take the ActorTrainer, `t`)."""

from __future__ import annotations

import logging
import threading

from services.dcs.client import DCSError
from services.run_contract.partitions import partition_name
from services.run_state.trainer_progress import TrainerProgress, read_progress, write_progress

log = logging.getLogger(__name__)


def latest_published(t) -> int:
    try:
        return t.dcs.latest_weights(t.config.run_id).version
    except DCSError as exc:
        if exc.status == 404:
            return 0
        raise


def resume_position(t, ckpt) -> tuple[int, int]:
    """(next step, version) to continue from. The checkpoint holds the weights; the progress record
    says how far the previous process got. Steps it finished after the checkpoint are lost with its
    weights (their partitions are cleared) and are not retrained; steps the checkpoint covers but the
    progress does not are finished here. The step in progress is retrained from its first row."""
    progress = read_progress(t.redis, t.config.run_id)
    if progress.next_step > 0 or ckpt:
        t.weights.sender.resume_engines()  # a predecessor killed mid-sync may have left them paused
    step, version = (ckpt.next_step, ckpt.version) if ckpt else (0, 0)
    if progress.next_step > step:
        log.warning(
            "steps after the checkpoint were lost with the process that trained them",
            extra={"from": step, "to": progress.next_step},
        )
        step = progress.next_step
    # steps the checkpoint covers, and finished steps a stopped predecessor left uncleared (its clears run in
    # step order and stop when it is halted mid-wait, so those are the steps just before `step`)
    for covered in range(progress.next_step, step):
        if t.steps.info(covered) is not None:
            t.clearing.clear(covered, threading.Event())
    for left in range(min(progress.next_step, step) - 1, -1, -1):
        if t.steps.info(left) is None:
            break
        t.clearing.clear(left, threading.Event())
    latest = latest_published(t)
    if latest > version:
        version = t.weights.publish(latest + 1)  # renumber: receivers hold newer weights than ours
    elif latest < version:
        version = t.weights.publish(version)  # checkpointed but not yet published
    # rows a dead predecessor held under its lease go back now, not when the lease lapses: the step it was
    # training, and the next one, whose rows it claims while the step before is published
    for held in range(step, min(step + 2, t.run.num_steps)):
        if t.steps.info(held) is not None:
            t.tq.reset_task(partition_name(t.run.name, held), t.actor_task)
    write_progress(t.redis, t.config.run_id, TrainerProgress(next_step=step, version=version))
    log.info(
        "trainer position", extra={"next_step": step, "version": version, "checkpoint": ckpt.path if ckpt else None}
    )
    return step, version
