"""`sluice demo`: the main job on one machine.

For now (the data plane): start a private Redis, a TransferQueue controller and storage shards as
separate processes, stream one partition through while it is being written (a producer thread puts
groups of samples like a rollout would; a StreamingDataLoader consumes micro-batches as they become
ready), check that every sample arrived exactly once and byte-exact, and print throughput as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from services.transferqueue.client.dataloader import StreamingDataLoader, StreamingDataset
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.local_stack import LocalTransferQueue


def _producer(tq: TransferQueue, partition: str, samples: int, seq_len: int, put_rows: int, errors: list) -> None:
    try:
        for start in range(0, samples, put_rows):
            n = min(put_rows, samples - start)
            ids = torch.arange(start, start + n, dtype=torch.int64)
            tq.put(partition, {
                "sample_id": ids,
                "input_ids": ids[:, None] * seq_len + torch.arange(seq_len)[None, :],
                "log_probs": torch.full((n, seq_len), -1.0) / (ids[:, None] + 1),
            })
        tq.seal_partition(partition)
    except Exception as exc:  # surfaced by the main thread
        errors.append(exc)


def run(args) -> dict:
    torch.set_num_threads(1)
    with LocalTransferQueue(shards=args.shards) as stack:
        with TransferQueue(stack.controller_address) as tq:
            partition = "demo_0"
            tq.create_partition(partition, group_size=args.group_size)
            tq.register_task("demo_train", ["sample_id", "input_ids", "log_probs"], group_size=args.group_size)
            errors: list = []
            start = time.perf_counter()
            producer = threading.Thread(target=_producer, daemon=True,
                                        args=(tq, partition, args.samples, args.seq_len, args.put_rows, errors))
            producer.start()
            loader = StreamingDataLoader(StreamingDataset(stack.controller_address, partition, "demo_train",
                                                          args.micro_batch, poll_s=2.0))
            seen = torch.zeros(args.samples, dtype=torch.int64)
            batches = 0
            first_batch_s = None
            for batch in loader:
                if first_batch_s is None:
                    first_batch_s = time.perf_counter() - start
                ids = batch["sample_id"]
                expected = ids[:, None] * args.seq_len + torch.arange(args.seq_len)[None, :]
                if not torch.equal(batch["input_ids"], expected):
                    raise RuntimeError(f"input_ids of samples {ids.tolist()[:4]}... came back altered")
                seen[ids] += 1
                batches += 1
            elapsed = time.perf_counter() - start
            producer.join()
            if errors:
                raise errors[0]
            info = tq.partition(partition)
            tq.clear_partition(partition)
    if not bool((seen == 1).all()):
        raise RuntimeError(f"samples seen other than once: {int((seen != 1).sum())}")
    payload = args.samples * args.seq_len * (8 + 4) + args.samples * 8
    return {
        "samples": args.samples,
        "micro_batches": batches,
        "payload_mb": round(payload / 1e6, 2),
        "seconds": round(elapsed, 3),
        "end_to_end_mb_per_s": round(payload / 1e6 / elapsed, 1),
        "samples_per_s": round(args.samples / elapsed, 1),
        "first_batch_after_s": round(first_batch_s or 0.0, 3),
        "every_sample_once": True,
        "consumed_by_task": {t.task: t.consumed for t in info.tasks},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--put-rows", type=int, default=256, help="rows per producer put")
    parser.add_argument("--micro-batch", type=int, default=128, help="rows per consumer micro-batch")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt group")
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args(argv)
    if args.put_rows % args.group_size or args.micro_batch % args.group_size:
        parser.error("--put-rows and --micro-batch must be multiples of --group-size")
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
