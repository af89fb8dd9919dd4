"""The TransferQueue tasks the trainer consumes, and how it claims a whole global batch of one."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from services.run_contract.partitions import ACTOR_TRAIN_TASK, task_name
from services.run_contract.run_config import RunConfig
from services.run_state.step_partitions import partition_gone
from services.run_state.seams import DataPlane
from services.transferqueue.errors import TQError

log = logging.getLogger(__name__)

ACTOR_TASK = ACTOR_TRAIN_TASK
CRITIC_VALUES_TASK, CRITIC_TRAIN_TASK = "critic_values", "critic_train"


def expected_tasks(run: RunConfig) -> list[str]:
    """Every task of the run (its scoped names) that must consume a partition before it is cleared."""
    tasks = [ACTOR_TASK, "advantage"]
    if run.uses_actor_fwd:
        tasks.append("actor_fwd")
    if run.uses_reference:
        tasks.append("reference")
    if run.uses_critic:
        tasks += [CRITIC_VALUES_TASK, CRITIC_TRAIN_TASK]
    return [task_name(run.name, t) for t in tasks]


def read_or_give_back(tq: DataPlane, claimed, fields):
    """The claimed rows' fields; None (the lease given back) if some were lost with their storage shard
    (DATA_LOSS): the controller took the lost groups out of the lease, so claiming again gets the others
    and waits for the rollout's replacements (services/rollout/lost_groups.py)."""
    try:
        return tq.read_claimed(claimed, fields)
    except TQError as exc:
        if exc.code != grpc.StatusCode.DATA_LOSS:
            raise
        log.warning("claimed rows were lost with a storage shard; claiming again", extra={"error": exc.message})
        tq.release(claimed.lease_id)
        return None


def claim_global_batch(
    tq: DataPlane,
    partition: str,
    task: str,
    rows: int,
    lease_s: float,
    halt: threading.Event,
    idle: Callable[[], None] = lambda: None,
    claim_key: str = "",
    short_ok: bool = False,
):
    """Claim exactly `rows` rows (whole groups) without reading them, waiting while the partition fills;
    None if halted or the partition ran out. `idle` runs between polls (a pause safe point).
    Data-parallel ranks pass the leader's claim_key to get the same lease. With `short_ok`, fewer rows
    are taken when that is all the partition will ever have for the task (the controller answers a claim
    short of min_rows only then): the critic's rows lost after the actor trained them are not replaced."""
    while not halt.is_set():
        idle()
        try:  # one long-polling claim that answers once `rows` are ready (fewer only at its deadline)
            claimed = tq.claim_rows(
                partition, task, rows, wait_s=2.0, lease_s=lease_s, min_rows=rows, claim_key=claim_key
            )
        except TQError as exc:
            if partition_gone(exc):
                return None
            raise
        if len(claimed.rows) == rows or (short_ok and claimed.rows):
            return claimed
        if claimed.rows:
            tq.release(claimed.lease_id)
        elif claimed.complete:
            return None
    return None
