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

import threading
from dataclasses import dataclass
from typing import Callable

from services.run_contract.partitions import partition_name, step_of
from services.run_state.seams import DataPlane
from services.run_state.step_partitions import StepPartitions, claim_or_done, put_once
from services.runtime.spans import span
from services.transferqueue.codec import Batch


@dataclass
class Consumer:
    """What a consuming role declares."""

    task: str                                  # the TransferQueue task its claims are made under
    rows: int                                  # rows per claim (whole groups)
    compute: Callable[[Batch], dict]           # claimed rows -> the columns to write into them
    compute_span: str = "compute"              # the span name of compute (forward, advantage, ...)
    min_rows: int = 0                          # answer a claim as soon as this many are ready
    prepare: Callable[[], None] = lambda: None  # before each claim (e.g. take newer weights)
    version: Callable[[], int | None] = lambda: None  # the weight version spans are tagged with
    done: Callable[[Batch], None] = lambda batch: None  # after each ack (metrics, status)


def consume_partition(tq: DataPlane, partition: str, consumer: Consumer, lease_s: float, group_size: int,
                      safe_point: Callable[[], None], halt: threading.Event) -> None:
    """Claim -> compute -> put -> ack until `partition` is done for the consumer's task (or halt)."""
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
            continue
        with span(consumer.compute_span, step, version):
            columns = consumer.compute(batch)
        with span("put", step, version):
            put_once(tq, partition, columns, batch.rows, group_size)
        tq.ack(batch)
        consumer.done(batch)


def each_step(steps: StepPartitions, num_steps: int, halt: threading.Event, safe_point: Callable[[], None],
              work: Callable[[int, str], None], idle: Callable[[], None] | None = None) -> None:
    """work(step, partition) for every step from where the trainer is, once its partition exists; steps the
    trainer finished meanwhile are skipped. `idle` runs while waiting (default: the safe point)."""
    step = steps.first_step()
    while step < num_steps and not halt.is_set():
        safe_point()
        if steps.wait_for(step, halt, idle or safe_point):
            work(step, partition_name(steps.run.name, step))
        step += 1
