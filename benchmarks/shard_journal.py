"""What the shard's write-ahead journal costs a put, and how fast a killed shard is back: prints one JSON
object to stdout (progress to stderr).

Workload: puts of N rows (256 rows per put by default) of `input_ids` int64[1024] + `log_probs`
float32[1024] (12 KiB a row), through the real client against a private redis-server, a controller and
one shard, each its own process; the same puts against a shard without a journal (memory only, the
baseline) and with one (`--data-dir`, no fsync: the default), and with `--journal-fsync`. Each rep puts
`--rows` rows into a fresh partition and clears it; the figure is the median over `--reps` reps after
one untimed warm-up.

Recovery: the journaled shard holding `--rows` rows is killed with SIGKILL and started again on the same
port and directory; `recover_s` is process start to the rows read back (replay + registration).

Usage: python benchmarks/shard_journal.py [--rows 4096] [--reps 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pool

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from services.transferqueue.client.queue import TransferQueue  # noqa: E402
from services.transferqueue.local_stack import LocalTransferQueue  # noqa: E402

ROW_BYTES = 1024 * 8 + 1024 * 4


def _columns(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 32000, (n, 1024)), "log_probs": torch.randn(n, 1024)}


def _put_rate(tq: TransferQueue, rows: int, per_put: int, reps: int) -> dict:
    """MB/s of puts, median over reps (one untimed warm-up rep first)."""
    batches = [_columns(per_put) for _ in range(rows // per_put)]
    rates = []
    for rep in range(reps + 1):
        name = f"bench-{rep}"
        tq.create_partition(name)
        started = time.perf_counter()
        for batch in batches:
            tq.put(name, batch)
        elapsed = time.perf_counter() - started
        tq.clear_partition(name)
        if rep:
            rates.append(rows * ROW_BYTES / 1e6 / elapsed)
    return {"put_mb_s": round(statistics.median(rates), 1), "reps_mb_s": [round(r, 1) for r in rates]}


def _measure(label: str, shard_args: tuple[str, ...], data_dir: str | None, args) -> dict:
    print(f"[{label}] starting a stack", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as logs:
        with LocalTransferQueue(shards=1, log_dir=logs, data_dir=data_dir, shard_args=shard_args) as stack:
            with TransferQueue(stack.controller_address) as tq:
                result = _put_rate(tq, args.rows, args.per_put, args.reps)
                if data_dir:
                    result["recover_s"] = _recover(stack, tq, args.rows)
    print(f"[{label}] {result}", file=sys.stderr)
    return result


def _recover(stack: LocalTransferQueue, tq: TransferQueue, rows: int) -> float:
    tq.create_partition("held")
    tq.register_task("bench", ["input_ids"])
    for _ in range(rows // 256):
        tq.put("held", _columns(256))
    stack.shards[0].kill()
    started = time.perf_counter()
    stack.restart_shard(0)
    got = tq.claim("held", "bench", rows)
    elapsed = time.perf_counter() - started
    assert len(got.rows) == rows, f"{len(got.rows)} of {rows} rows back after the restart"
    return round(elapsed, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="rows per rep")
    p.add_argument("--per-put", type=int, default=256, help="rows per put call")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-journal-") as root:
        memory = _measure("memory only", (), None, args)
        journal = _measure("journal", (), os.path.join(root, "a"), args)
        fsync = _measure("journal+fsync", ("--journal-fsync",), os.path.join(root, "b"), args)
    print(
        json.dumps(
            {
                "rows": args.rows,
                "rows_per_put": args.per_put,
                "row_bytes": ROW_BYTES,
                "reps": args.reps,
                "memory_only": memory,
                "journal": journal,
                "journal_fsync": fsync,
                "journal_put_ratio": round(journal["put_mb_s"] / memory["put_mb_s"], 3),
                "journal_fsync_put_ratio": round(fsync["put_mb_s"] / memory["put_mb_s"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
