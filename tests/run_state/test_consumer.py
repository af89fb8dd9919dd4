"""consume_partition against the real data plane: a lease that lapses while the role computes (a storage shard
or the process stalled longer than the lease) costs a recompute, never the role."""

import threading
import time

import torch

from services.run_state.consumer import Consumer, consume_partition


def test_a_lease_that_lapses_before_the_ack_is_claimed_again_and_consumed_once(tq, uniq):
    part, task = uniq("p"), uniq("t")
    tq.create_partition(part, group_size=2)
    tq.register_task(task, ["tokens"], group_size=2)
    rows = tq.put(part, {"tokens": [torch.arange(3)] * 4})
    tq.seal_partition(part)
    computed, done = [], []

    def compute(batch):
        computed.append(list(batch.rows))
        if len(computed) == 1:
            time.sleep(3.0)  # past the 2 s lease: the ack after this put is refused
        return {"score": torch.full((len(batch.rows),), float(len(computed)))}

    consumer = Consumer(task=task, rows=4, compute=compute, done=lambda batch: done.append(list(batch.rows)))
    consume_partition(tq, part, consumer, lease_s=2.0, group_size=2, safe_point=lambda: None, halt=threading.Event())
    assert computed == [rows, rows]  # claimed again once the lease lapsed
    assert done == [rows]  # ... and acked once
    assert [float(x) for x in tq.get(part, rows, ["score"])["score"]] == [1.0] * 4  # the first write stands
    info = tq.partition(part)
    assert [t.consumed for t in info.tasks if t.task == task] == [4]
