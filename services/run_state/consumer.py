"""The loop every consuming role runs (forward, advantage, the critic's values), written once:

    for step N from where the trainer is:
        wait for train_N (colocate: the whole batch)                      StepPartitions.wait_for
        until train_N is done for the task:
            safe point; the role's own preparation (e.g. take newer weights)
            claim rows that have every field the task needs (whole groups, under a lease)
            -> the role's compute(batch) -> columns -> put them (put_once) -> ack

A role declares what it claims and computes in a `Consumer`; leases, pause safe points, at-least-once
puts, acks and spans are the driver's."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import grpc

from services.run_contract.partitions import partition_name, step_of
from services.run_state.seams import DataPlane
from services.run_state.step_partitions import StepPartitions, claim_or_done, put_once
from services.runtime.spans import span
from services.transferqueue.codec import Batch
from services.transferqueue.errors import TQError

log = logging.getLogger(__name__)


@dataclass
class Consumer:
    """What a consuming role declares."""

    task: str  # the TransferQueue task its claims are made under
    rows: int  # rows per claim (whole groups)
    compute: Callable[[Batch], dict]  # claimed rows -> the columns to write into them
    compute_span: str = "compute"  # the span name of compute (forward, advantage, ...)
    min_rows: int = 0  # answer a claim as soon as this many are ready
    prepare: Callable[[], None] = lambda: None  # before each claim (e.g. take newer weights)
    version: Callable[[], int | None] = lambda: None  # the weight version spans are tagged with
    done: Callable[[Batch], None] = lambda batch: None  # after each ack (metrics, status)


def consume_partition(
    tq: DataPlane,
    partition: str,
    consumer: Consumer,
    lease_s: float,
    group_size: int,
    safe_point: Callable[[], None],
    halt: threading.Event,
    idle: Callable[[], None] = lambda: None,
) -> None:
    """Claim -> compute -> put -> ack until `partition` is done for the consumer's task (or halt); `idle`
    runs whenever a claim found nothing ready."""
    step = step_of(partition)
    while not halt.is_set():
        safe_point()
        consumer.prepare()
        version = consumer.version()
        with span("claim", step, version):
            batch = claim_or_done(tq, partition, consumer.task, consumer.rows, lease_s, min_rows=consumer.min_rows)
        if batch is None:
            return
        if not batch.rows:
            idle()
            continue
        with span(consumer.compute_span, step, version):
            columns = consumer.compute(batch)
        with span("put", step, version):
            put_once(tq, partition, columns, batch.rows, group_size)
        if ack_or_lapsed(tq, batch):
            consumer.done(batch)


def ack_or_lapsed(tq: DataPlane, batch: Batch) -> bool:
    """Ack `batch`; False when its lease had lapsed (a storage shard or this process stalled longer than the
    lease) and the rows went back to the queue. Nothing is lost then: the columns are already written, and
    whoever claims the rows next finds them written (put_once) and acks them."""
    try:
        tq.ack(batch)
        return True
    except TQError as exc:
        if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        log.warning("lease lapsed before the ack; the rows were handed out again", extra={"error": exc.message})
        return False


def each_step(
    steps: StepPartitions,
    num_steps: int,
    halt: threading.Event,
    safe_point: Callable[[], None],
    work: Callable[[int, str, Callable[[], None]], None],
    task: str,
    idle: Callable[[], None] | None = None,
) -> None:
    """work(step, partition, behind) for every step from where the trainer is, once its partition exists; steps
    the trainer finished meanwhile are skipped. `idle` runs while waiting (default: the safe point).
    `behind` is for work to run while it has nothing to do (consume_partition's idle): it goes back to
    earlier steps that lost rows with a storage shard and are not done for `task` (StepPartitions.reopened),
    whose replacements the trainer waits for while this role waits ahead of it."""
    current, revisiting = [steps.first_step()], [False]

    def behind() -> None:
        if revisiting[0]:
            return
        revisiting[0] = True
        try:
            for earlier in steps.reopened(current[0], task):
                work(earlier, partition_name(steps.run.name, earlier), lambda: None)
        finally:
            revisiting[0] = False

    while current[0] < num_steps and not halt.is_set():
        safe_point()
        if steps.wait_for(current[0], halt, idle or safe_point):
            work(current[0], partition_name(steps.run.name, current[0]), behind)
        current[0] += 1
