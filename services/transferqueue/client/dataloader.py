"""StreamingDataset / StreamingDataLoader: micro-batches from a partition while it is still being written.

Each iteration claims `micro_batch_size` rows for a task (long-polling, never spinning), reads their
fields, and yields a Batch. The previous batch is acked when the next one is requested (or when
iteration ends), so a consumer that crashes mid-batch leaves it to be handed out again. Iteration
ends once the partition is sealed and every row has been consumed by the task.

Data parallelism: ranks of one DP group pass the same `dp_size` and `group_id`; at every step they
claim one shared batch of `micro_batch_size * dp_size` rows (the same lease, through a claim key),
split it into token-balanced parts by `balance_field` (a scalar per row, e.g. the sequence length),
and each rank reads and acks only its part. Ranks must iterate in lockstep (as DP training does).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, IterableDataset

from services.transferqueue.client.balance import balanced_split
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.codec import Batch


class StreamingDataset(IterableDataset):
    def __init__(
        self,
        controller: str,
        partition: str,
        task: str,
        micro_batch_size: int,
        fields: Sequence[str] | None = None,
        token: str | None = None,
        padded=False,
        pad_value=0,
        poll_s: float = 5.0,
        lease_s: float = 300.0,
        auto_ack: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
        group_id: str = "",
        balance_field: str | None = None,
    ):
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1")
        if dp_size > 1 and not group_id:
            raise ValueError("data-parallel ranks need a shared group_id (e.g. the run id and step)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
        self.controller = controller
        self.partition = partition
        self.task = task
        self.micro_batch_size = micro_batch_size
        self.fields = list(fields) if fields is not None else None
        self.token = token
        self.padded = padded
        self.pad_value = pad_value
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.auto_ack = auto_ack
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.group_id = group_id
        self.balance_field = balance_field

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError("StreamingDataset streams from one claim loop: use num_workers <= 1")
        with TransferQueue(self.controller, self.token) as tq:
            batches = self._single(tq) if self.dp_size == 1 else self._shared(tq)
            for batch in batches:
                try:
                    yield batch
                finally:
                    # the consumer asked for the next batch (or stopped): this one is done. Ack it
                    # before claiming again, or the last batch would keep the partition incomplete.
                    if self.auto_ack:
                        self._ack(tq, batch)

    def _ack(self, tq: TransferQueue, batch: Batch) -> None:
        if batch.rows:
            tq.ack(batch.lease_id, batch.rows if self.dp_size > 1 else ())

    def _single(self, tq: TransferQueue) -> Iterator[Batch]:
        while True:
            batch = tq.claim(
                self.partition,
                self.task,
                self.micro_batch_size,
                self.fields,
                wait_s=self.poll_s,
                lease_s=self.lease_s,
                padded=self.padded,
                pad_value=self.pad_value,
            )
            if batch.rows:
                yield batch
            elif batch.complete:
                return

    def _shared(self, tq: TransferQueue) -> Iterator[Batch]:
        fields = self.fields if self.fields is not None else tq._fields_of(self.task)
        step = 0
        while True:
            claimed = tq.claim_rows(
                self.partition,
                self.task,
                self.micro_batch_size * self.dp_size,
                wait_s=self.poll_s,
                lease_s=self.lease_s,
                claim_key=f"{self.group_id}-{self.partition}-{step}",
            )
            if not claimed.rows:
                if claimed.complete:
                    return
                continue
            step += 1
            mine = self._my_rows(tq, claimed.rows, claimed.group_size)
            if not mine:
                yield Batch(partition=self.partition, rows=[], columns={}, lease_id=claimed.lease_id)
                continue
            batch = tq.get(self.partition, mine, fields, padded=self.padded, pad_value=self.pad_value)
            batch.lease_id = claimed.lease_id
            yield batch

    def _my_rows(self, tq: TransferQueue, rows: list[int], group_size: int) -> list[int]:
        groups = [rows[i : i + group_size] for i in range(0, len(rows), group_size)]
        if self.balance_field:
            weights_by_row = tq.get(self.partition, rows, [self.balance_field])[self.balance_field]
            w = weights_by_row.double().tolist()
            weights = [sum(w[i : i + group_size]) for i in range(0, len(rows), group_size)]
        else:
            weights = [1.0] * len(groups)
        part = balanced_split(weights, self.dp_size)[self.dp_rank]
        return [r for g in part for r in groups[g]]


class StreamingDataLoader(DataLoader):
    """A DataLoader over a StreamingDataset that yields its micro-batches as they are (batch_size=None).

    A worker (num_workers=1) is spawned, never forked: this process has gRPC loaded, and gRPC's fork
    handlers can deadlock a fork while its threads run."""

    def __init__(self, dataset: StreamingDataset, **kwargs):
        kwargs.setdefault("num_workers", 0)
        if kwargs["num_workers"] > 0:
            kwargs.setdefault("multiprocessing_context", "spawn")
        # batch_size=None: collate_fn gets each item itself, not the list torch's hint assumes
        super().__init__(dataset, batch_size=None, collate_fn=_identity, **kwargs)  # type: ignore[arg-type]


def _identity(batch: Batch) -> Batch:
    return batch
