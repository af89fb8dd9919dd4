"""How a consuming role walks the steps: start where the trainer is, wait for <run_id>/train_<N> to appear,
skip steps the trainer has already finished (their partitions are cleared), and in colocate mode
wait for the whole batch before starting (no overlap with rollout)."""

from __future__ import annotations

import threading
from typing import Callable

import grpc

from services.run_contract.run_config import RunConfig
from services.run_contract.partitions import partition_name
from services.run_state.seams import DataPlane
from services.run_state.trainer_progress import TrainerProgress
from services.transferqueue.errors import TQError


def partition_gone(exc: Exception) -> bool:
    """The partition was cleared: the trainer clears one only after every task consumed all of it,
    so a consumer that sees this is done with it (it just had not observed `complete` yet)."""
    return isinstance(exc, TQError) and exc.code == grpc.StatusCode.NOT_FOUND


class StepPartitions:
    def __init__(self, tq: DataPlane, progress: Callable[[], TrainerProgress], run: RunConfig, poll_s: float = 0.2):
        self.tq = tq
        self._progress = progress  # the trainer's progress record (Redis, services/run_state/trainer_progress.py)
        self.run = run
        self.poll_s = poll_s

    def trainer_progress(self) -> TrainerProgress:
        return self._progress()

    def first_step(self) -> int:
        return self.trainer_progress().next_step

    def info(self, step: int):
        try:
            return self.tq.partition(partition_name(self.run.name, step))
        except TQError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def reopened(self, before: int, task: str) -> list[int]:
        """Steps from the trainer's up to `before` whose partitions lost rows with a storage shard and are not
        done for `task`: the rollout writes replacements (services/rollout/lost_groups.py) that a consumer
        which had finished the step must go back for."""
        out = []
        for step in range(self.first_step(), before):
            info = self.info(step)
            if info is None or not getattr(info, "lost_rows", 0):
                continue
            consumed = next((t.consumed for t in info.tasks if t.task == task), 0)
            if not info.sealed or consumed < info.rows:
                out.append(step)
        return out

    def wait_for(self, step: int, halt: threading.Event, idle: Callable[[], None] = lambda: None) -> bool:
        """True once train_<step> exists (and, in colocate mode, is sealed: the whole batch is
        written); False if the trainer is already past it or `halt` is set. `idle` runs on every
        poll (a pause safe point: waiting here holds nothing)."""
        while not halt.is_set():
            idle()
            if self.trainer_progress().next_step > step:
                return False
            info = self.info(step)
            if info is not None and (info.sealed or self.run.mode != "colocate"):
                return True
            halt.wait(self.poll_s)
        return False


def claim_or_done(
    tq: DataPlane, partition: str, task: str, rows: int, lease_s: float, wait_s: float = 1.0, min_rows: int = 0
):
    """The next batch of `task` rows (empty if none became ready within wait_s), or None once the
    partition is done for the task (sealed and consumed, or already cleared)."""
    try:
        batch = tq.claim(partition, task, rows, wait_s=wait_s, lease_s=lease_s, min_rows=min_rows)
    except TQError as exc:
        if partition_gone(exc):
            return None
        raise
    if not batch.rows and batch.complete:
        return None
    return batch


def put_once(tq: DataPlane, partition: str, columns: dict, rows: list[int], group_size: int) -> None:
    """Write fields of claimed rows, tolerating rows a previous holder of the claim already wrote
    (claims are at-least-once: a consumer that died after its put but before its ack leaves rows that
    come back with the field produced). On such a conflict each group is written on its own and the
    groups already written are left as they are."""
    try:
        tq.put(partition, columns, rows=rows)
        return
    except TQError as exc:
        if exc.code != grpc.StatusCode.ALREADY_EXISTS:
            raise
    for start in range(0, len(rows), group_size):
        part = {name: values[start : start + group_size] for name, values in columns.items()}
        try:
            tq.put(partition, part, rows=rows[start : start + group_size])
        except TQError as exc:
            if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
