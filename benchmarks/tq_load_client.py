"""A client process of benchmarks/tq_load.py (the load test; its docstring describes the workload):
--producers + --consumers asyncio clients, each its own AsyncTransferQueue, on this process's own stream of
partitions. Waits for the driver's go file, runs --duration-s, drains, and writes its counts, latencies
and errors as JSON to <sync-dir>/result-<worker-id>.json (JSON, never pickle, across processes).

Usage (started by tq_load.py): python benchmarks/tq_load_client.py CONTROLLER --worker-id I --producers P
       --consumers C --duration-s S --epoch-s E --sync-dir DIR
"""

from __future__ import annotations

import os

# one torch/BLAS thread, set before torch loads (decoding a claim builds torch tensors)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from services.transferqueue.client.queue import AsyncTransferQueue  # noqa: E402
from services.transferqueue.errors import TQError  # noqa: E402

ROW_LEN = 256
PUT_ROWS = 16
CLAIM_ROWS = 32
CLAIM_WAIT_S = 0.1
ERROR_PAUSE_S = 0.05  # after a failed call: a persistent failure must not become a hot loop
DRAIN_S = 60.0
TASK = "load"
FIELD = "input_ids"


class Tally:
    """One client process's counts, latencies, errors and the row values it put and acked."""

    def __init__(self):
        self.counts = collections.Counter()
        self.errors = collections.Counter()
        self.error_samples: list[str] = []
        self.claim_s: list[float] = []
        self.read_s: list[float] = []
        self.put_s: list[float] = []
        self.put_values: list[int] = []
        self.acked_values: list[int] = []

    def error(self, op: str, exc: BaseException) -> None:
        kind = exc.code.name if isinstance(exc, TQError) else type(exc).__name__
        self.errors[f"{op}:{kind}"] += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{op}: {exc!r}"[:300])


class Stream:
    """The process's partitions, oldest first. Single event loop: the counters need no locks."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.epoch = 0
        self.current = self.name(0)
        self.open = [self.current]  # created, not yet cleared
        self.done: set[str] = set()  # a claim said: sealed and fully acked
        self.producing = True
        self.puts_in_flight = collections.Counter()
        self.claims_in_flight = collections.Counter()

    def name(self, epoch: int) -> str:
        return f"{self.prefix}-e{epoch}"

    def claim_target(self) -> str | None:
        """The oldest partition not done; None once producers stopped and everything is done."""
        for part in self.open:
            if part not in self.done:
                return part
        return None if not self.producing else self.current


async def producer(tq: AsyncTransferQueue, cid: int, stream: Stream, stop_at: float, tally: Tally) -> None:
    seq = 0
    while time.perf_counter() < stop_at:
        values = (cid << 32) + seq + np.arange(PUT_ROWS, dtype=np.int64)
        seq += PUT_ROWS
        payload = {FIELD: np.repeat(values[:, None], ROW_LEN, axis=1)}
        part = stream.current  # taken and counted in one step: the rotation seals only idle partitions
        stream.puts_in_flight[part] += 1
        try:
            start = time.perf_counter()
            await tq.put(part, payload)
            tally.put_s.append(time.perf_counter() - start)
            tally.counts["puts"] += 1
            tally.put_values.extend(values.tolist())
        except Exception as exc:  # counted, never hidden
            tally.error("put", exc)
            await asyncio.sleep(ERROR_PAUSE_S)
        finally:
            stream.puts_in_flight[part] -= 1


def check_rows(batch, tally: Tally) -> list[int]:
    ids = batch[FIELD]
    if tuple(ids.shape) != (len(batch), ROW_LEN):
        tally.errors["corrupt_rows"] += len(batch)
        return []
    ids = ids.numpy()
    constant = ids.min(axis=1) == ids.max(axis=1)
    tally.errors["corrupt_rows"] += int((~constant).sum())
    return ids[constant, 0].tolist()


async def claim_once(tq: AsyncTransferQueue, part: str, tally: Tally):
    """claim() in its two halves (the same calls), so that the read from the shard is also timed alone.
    -> (ClaimedRows, Batch or None when the long poll ended without rows)."""
    start = time.perf_counter()
    claimed = await tq.claim_rows(part, TASK, CLAIM_ROWS, wait_s=CLAIM_WAIT_S)
    if not claimed.rows:
        return claimed, None
    got = time.perf_counter()
    try:
        batch = await tq.read_claimed(claimed, [FIELD])
    except BaseException:
        await tq.release(claimed.lease_id)  # as claim() does: the rows go back to the queue at once
        raise
    end = time.perf_counter()
    tally.claim_s.append(end - start)
    tally.read_s.append(end - got)
    return claimed, batch


async def consumer(tq: AsyncTransferQueue, stream: Stream, stop_at: float, tally: Tally) -> None:
    while (part := stream.claim_target()) is not None:
        stream.claims_in_flight[part] += 1
        op = "claim"
        try:
            claimed, batch = await claim_once(tq, part, tally)
            if batch is not None:
                tally.counts["claims"] += 1
                values = check_rows(batch, tally)
                op = "ack"
                await tq.ack(batch)
                tally.acked_values.extend(values)  # only once acked: an unacked lease comes back later
                if time.perf_counter() < stop_at:
                    tally.counts["rows_acked_in_window"] += len(batch)
            else:
                tally.counts["empty_claims"] += 1
            if claimed.complete:
                stream.done.add(part)
        except Exception as exc:
            tally.error(op, exc)
            await asyncio.sleep(ERROR_PAUSE_S)
        finally:
            stream.claims_in_flight[part] -= 1


async def seal_when_idle(admin: AsyncTransferQueue, stream: Stream, part: str) -> None:
    while stream.puts_in_flight[part]:
        await asyncio.sleep(0.005)
    await admin.seal_partition(part)


async def clear_done(admin: AsyncTransferQueue, stream: Stream) -> None:
    for part in [p for p in stream.open if p in stream.done and not stream.claims_in_flight[p]]:
        await admin.clear_partition(part)
        stream.open.remove(part)


async def rotate(admin: AsyncTransferQueue, stream: Stream, stop_at: float, epoch_s: float, tally: Tally) -> None:
    """Every epoch_s: next partition, seal the previous one; clear finished ones."""
    next_switch = time.perf_counter() + epoch_s
    while True:
        await asyncio.sleep(max(0.0, min(next_switch, stop_at) - time.perf_counter()))
        try:
            await clear_done(admin, stream)
            if time.perf_counter() >= stop_at:
                return
            new = stream.name(stream.epoch + 1)
            await admin.create_partition(new)
            old, stream.epoch, stream.current = stream.current, stream.epoch + 1, new
            stream.open.append(new)
            await seal_when_idle(admin, stream, old)
        except Exception as exc:
            tally.error("rotate", exc)
        next_switch += epoch_s


async def drain(admin: AsyncTransferQueue, stream: Stream, consumers: list, tally: Tally) -> None:
    """Producers are done: seal the last partition, let consumers finish everything, clear it all."""
    stream.producing = False
    try:
        await seal_when_idle(admin, stream, stream.current)
    except Exception as exc:
        tally.error("seal", exc)
    deadline = time.perf_counter() + DRAIN_S
    while stream.open and time.perf_counter() < deadline:
        try:
            await clear_done(admin, stream)
        except Exception as exc:
            tally.error("clear", exc)
        await asyncio.sleep(0.02)
    if stream.open:
        tally.errors["drain_timeout"] += 1
        tally.error_samples.append(f"partitions not drained after {DRAIN_S}s: {stream.open}")
        for task in consumers:
            task.cancel()
    await asyncio.gather(*consumers, return_exceptions=True)


async def wait_for_go(sync_dir: str, worker_id: int) -> float:
    """Report ready, wait for the driver's go file; -> the start time on the wall clock."""
    with open(os.path.join(sync_dir, f"ready-{worker_id}"), "w") as f:
        f.write("ready")
    go = os.path.join(sync_dir, "go")
    while not os.path.exists(go):
        await asyncio.sleep(0.005)
    with open(go) as f:
        return float(f.read())


async def run_worker(args) -> dict:
    tally = Tally()
    stream = Stream(f"load-w{args.worker_id}")
    clients = [AsyncTransferQueue(args.controller) for _ in range(args.producers + args.consumers)]
    admin = AsyncTransferQueue(args.controller)
    await admin.create_partition(stream.current)
    start_wall = await wait_for_go(args.sync_dir, args.worker_id)
    stop_at = time.perf_counter() + (start_wall + args.duration_s - time.time())
    ids = [(args.worker_id << 12) + i for i in range(args.producers)]
    producers = [asyncio.create_task(producer(tq, cid, stream, stop_at, tally)) for tq, cid in zip(clients, ids)]
    consumers = [asyncio.create_task(consumer(tq, stream, stop_at, tally)) for tq in clients[args.producers :]]
    rotation = asyncio.create_task(rotate(admin, stream, stop_at, args.epoch_s, tally))
    await asyncio.gather(*producers, rotation)
    window_s = time.perf_counter() - stop_at + args.duration_s
    await drain(admin, stream, consumers, tally)
    for tq in [*clients, admin]:
        await tq.close()
    return {"producers": args.producers, "consumers": args.consumers, **worker_result(tally, window_s)}


def worker_result(tally: Tally, window_s: float) -> dict:
    put, acked = collections.Counter(tally.put_values), collections.Counter(tally.acked_values)
    tally.errors["lost_rows"] += sum((put - acked).values())
    tally.errors["duplicate_rows"] += sum(n - 1 for n in acked.values() if n > 1)
    tally.errors["unexpected_rows"] += sum((acked - put).values())  # acked, never put: a failed put landed
    return {
        "window_s": window_s,
        "cpu_s": time.process_time(),
        "counts": dict(tally.counts),
        "rows_put": len(tally.put_values),
        "rows_acked": len(tally.acked_values),
        "errors": {k: v for k, v in tally.errors.items() if v},
        "error_samples": tally.error_samples,
        "claim_s": tally.claim_s,
        "read_s": tally.read_s,
        "put_s": tally.put_s,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("controller")
    for name in ("--worker-id", "--producers", "--consumers"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--epoch-s", type=float, required=True)
    p.add_argument("--sync-dir", required=True)
    args = p.parse_args(argv)
    result = asyncio.run(run_worker(args))
    path = os.path.join(args.sync_dir, f"result-{args.worker_id}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
