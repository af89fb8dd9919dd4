"""StreamingDataLoader against a real stack: streams while the partition is written, ends when done."""

from __future__ import annotations

import threading
import time

import torch

from services.transferqueue.client.balance import balanced_split
from services.transferqueue.client.dataloader import StreamingDataLoader, StreamingDataset
from services.transferqueue.client.queue import TransferQueue


def _slow_producer(
    address,
    partition,
    groups,
    group_size,
    delay_s,
    sealed_at: list | None = None,
    before_last: threading.Event | None = None,
):
    """`before_last`: the last group (and the seal) waits for it, up to 30 s."""
    with TransferQueue(address) as tq:
        for g in range(groups):
            if g == groups - 1 and before_last is not None:
                before_last.wait(30)
            n = group_size
            ids = torch.arange(g * n, (g + 1) * n)
            tq.put(
                partition, {"sid": ids, "tokens": [torch.arange(int(i) % 7 + 1) for i in ids], "seq_len": (ids % 7 + 1)}
            )
            time.sleep(delay_s)
        tq.seal_partition(partition)
        if sealed_at is not None:
            sealed_at.append(time.monotonic())


def test_loader_streams_while_partition_is_written(tq_stack, tq, uniq):
    p, task = uniq("p"), uniq("t")
    tq.create_partition(p, group_size=2)
    tq.register_task(task, ["sid", "tokens"], group_size=2)
    sealed_at: list[float] = []
    first_batch = threading.Event()  # a loader that waited for the seal would hold the producer 30 s and fail
    producer = threading.Thread(
        target=_slow_producer, args=(tq_stack.controller_address, p, 12, 2, 0.1, sealed_at, first_batch)
    )
    producer.start()
    loader = StreamingDataLoader(StreamingDataset(tq_stack.controller_address, p, task, 4, poll_s=1.0, padded=True))
    seen, first_at = [], None
    for batch in loader:
        first_at = first_at or time.monotonic()
        first_batch.set()
        assert len(batch) <= 4 and len(batch) % 2 == 0
        assert batch["tokens"].dim() == 2 and batch.lengths["tokens"].tolist() == (batch["sid"] % 7 + 1).tolist()
        seen += batch["sid"].tolist()
    producer.join()
    assert sorted(seen) == list(range(24))
    assert first_at < sealed_at[0]  # the first micro-batch came while the producer was still writing
    info = tq.partition(p)
    assert [(t.consumed, t.leased) for t in info.tasks if t.task == task] == [(24, 0)]


def test_data_parallel_ranks_split_one_batch_by_tokens(tq_stack, tq, uniq):
    p, task = uniq("p"), uniq("t")
    tq.create_partition(p)
    tq.register_task(task, ["sid", "seq_len"])
    _slow_producer(tq_stack.controller_address, p, 16, 1, 0.0)
    per_rank, tokens = {0: [], 1: []}, {0: [], 1: []}

    def rank(r):
        ds = StreamingDataset(
            tq_stack.controller_address,
            p,
            task,
            4,
            fields=["sid", "seq_len"],
            dp_rank=r,
            dp_size=2,
            group_id="run1",
            balance_field="seq_len",
            poll_s=1.0,
        )
        for batch in ds:
            per_rank[r].extend(batch["sid"].tolist() if batch.rows else [])
            tokens[r].append(int(batch["seq_len"].sum()) if batch.rows else 0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(per_rank[0] + per_rank[1]) == list(range(16))  # every row once across ranks
    assert not set(per_rank[0]) & set(per_rank[1])
    # each shared batch of 8 rows was split by tokens, not by count
    for a, b in zip(tokens[0], tokens[1]):
        assert abs(a - b) <= 7


def test_balanced_split_evens_out_weights():
    weights = [8, 1, 1, 1, 1, 1, 1, 1, 1]
    parts = balanced_split(weights, 2)
    assert sorted(i for p in parts for i in p) == list(range(9))
    assert sorted(sum(weights[i] for i in p) for p in parts) == [8, 8]
    assert balanced_split([3, 3, 3], 2) == balanced_split([3, 3, 3], 2)  # deterministic
    assert balanced_split([], 3) == [[], [], []]


def test_loader_worker_is_spawned_not_forked(tq_stack, tq, uniq):
    """num_workers=1 streams from a spawned worker: forking this gRPC-using process could deadlock."""
    p, task = uniq("p"), uniq("t")
    tq.create_partition(p)
    tq.register_task(task, ["sid"])
    _slow_producer(tq_stack.controller_address, p, 6, 1, 0.0)
    loader = StreamingDataLoader(
        StreamingDataset(tq_stack.controller_address, p, task, 2, fields=["sid"]), num_workers=1
    )
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert sorted(sid for batch in loader for sid in batch["sid"].tolist()) == list(range(6))
