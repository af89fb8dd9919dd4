"""TransferQueue data-plane benchmark: prints one JSON object to stdout (progress goes to stderr).

Workload: N samples (4096; 512 with --quick) of `input_ids` int64[1024] + `log_probs` float32[1024]
(~50 MB at N=4096), held as torch tensors of shape [N, 1024], against a local stack of a private
redis-server, one controller and ONE storage shard (each its own process). MB = 1e6 bytes of
tensor payload (`nbytes`); samples = rows. Every throughput figure is the median of --reps runs
after one untimed warm-up run.

Measured:
  put          one N-row put call, and N/256 calls of 256 rows (fresh partition per run, cleared after).
  claim_get    claim(batch=N) reading both fields in one call, and 256-row claims until all N rows
               are consumed; every claim is acked and the ack is inside the timing.
  claim_latency_ms
               p50/p99 of a 1-row `claim_rows` (rows never read; the ack follows outside the timing)
               on a partition with plenty of ready rows: once with no other client, once while a
               second client *process* is parked in a long-poll claim on a partition/task that never
               gets data (confirmed through the controller's sluice_tq_waiting_claims gauge).
  ready_s      process start (spawn) to gRPC health SERVING: a controller against an already
               running redis; a shard against an already running controller (for a shard SERVING
               means registered with the controller).
  raw_grpc     the baseline: the same number of bytes over a loopback gRPC (grpc.aio server in a
               separate process, generic handlers, identity serializers, no protobuf) in chunks of
               the TQ client's size (4 MiB). As in TQ, the sender slices one contiguous buffer into
               chunks and the receiver joins the chunks into one contiguous buffer.
  ratios       TQ single-call put / raw put and TQ single-claim claim+get / raw get.

Usage: python benchmarks/tq_throughput.py [--quick] [--reps 5] [--latency-iters 2000]
Internal modes (child processes of the benchmark): --raw-server PORT, --blocker CONTROLLER.
"""

from __future__ import annotations

import os

# one torch/BLAS thread, set before torch loads its thread pools (children inherit it as well)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from grpc_health.v1 import health, health_pb2_grpc  # noqa: E402

from services.runtime.processes import ChildProcess, free_port, sluice_argv, start_redis  # noqa: E402
from services.transferqueue.client.channel import CHANNEL_OPTIONS  # noqa: E402
from services.transferqueue.client.queue import TransferQueue  # noqa: E402
from services.transferqueue.client.shard_client import CHUNK_BYTES  # noqa: E402
from services.transferqueue.local_stack import LocalTransferQueue, grpc_serving  # noqa: E402

SELF = os.path.abspath(__file__)
ROW_LEN = 1024
SMALL_BATCH = 256
FIELDS = ["input_ids", "log_probs"]
TASK = "bench"
LAT_TASK = "bench-latency"
LAT_FIELD = "x"
BLOCK_PARTITION = "bench-blocker"
BLOCK_TASK = "bench-blocker"
RAW_SERVICE = "sluice.bench.RawBytes"
# Health is checked per named service: grpc_health's HealthServicer reports the default service ""
# as SERVING from the moment the server starts, i.e. before a shard has registered with the controller.
CONTROLLER_HEALTH = "sluice.transferqueue.v1.Controller"
SHARD_HEALTH = "sluice.transferqueue.v1.StorageShard"
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]
TARGETS = {
    "put_mb_per_s_min": 650.0,
    "get_mb_per_s_min": 450.0,
    "claim_p50_ms_max": 0.5,
    "claim_p99_ms_max": 2.0,
    "ready_s_max": 2.0,
}

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- statistics


def throughput(seconds: list[float], nbytes: int, rows: int) -> dict:
    median = statistics.median(seconds)
    return {
        "median_s": round(median, 5),
        "mb_per_s": round(nbytes / median / 1e6, 1),
        "samples_per_s": round(rows / median, 1),
        "runs_s": [round(s, 5) for s in seconds],
    }


def latency_summary(seconds: np.ndarray) -> dict:
    ms = seconds * 1e3
    return {
        "iters": int(len(ms)),
        "p50_ms": round(float(np.percentile(ms, 50)), 4),
        "p90_ms": round(float(np.percentile(ms, 90)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
        "mean_ms": round(float(ms.mean()), 4),
        "max_ms": round(float(ms.max()), 4),
    }


def median_summary(seconds: list[float]) -> dict:
    return {"median_s": round(statistics.median(seconds), 4), "runs_s": [round(s, 4) for s in seconds]}


def timed_runs(run, reps: int) -> list[float]:
    """run(i) -> seconds, for i = 0 (warm-up, dropped) .. reps."""
    return [run(i) for i in range(reps + 1)][1:]


# ---------------------------------------------------------------------------------- payload


def make_payload(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 151_000, (rows, ROW_LEN), dtype=torch.int64, generator=g),
        "log_probs": -torch.rand((rows, ROW_LEN), dtype=torch.float32, generator=g),
    }


def payload_nbytes(payload: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in payload.values())


def row_slice(payload: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {name: t[lo:hi] for name, t in payload.items()}


# ---------------------------------------------------------------------------------- TQ put / claim+get


def bench_put(tq: TransferQueue, payload: dict, step: int, reps: int) -> list[float]:
    rows = len(payload["input_ids"])

    def run(i: int) -> float:
        partition = f"bench-put-{step}-{i}"
        tq.create_partition(partition)
        start = time.perf_counter()
        for lo in range(0, rows, step):
            tq.put(partition, row_slice(payload, lo, lo + step))
        seconds = time.perf_counter() - start
        tq.clear_partition(partition)
        return seconds

    return timed_runs(run, reps)


def consume(tq: TransferQueue, partition: str, batch_size: int, rows: int) -> None:
    """Claim (reading both fields) and ack until `rows` rows are consumed."""
    got = 0
    while got < rows:
        batch = tq.claim(partition, TASK, batch_size, fields=FIELDS)
        if not batch.rows:
            raise RuntimeError(f"claim on {partition} came back empty after {got} of {rows} rows")
        if batch["input_ids"].shape != (len(batch), ROW_LEN) or batch["log_probs"].shape != (len(batch), ROW_LEN):
            raise RuntimeError(f"claim on {partition} returned tensors of the wrong shape")
        tq.ack(batch)
        got += len(batch)


def bench_claim_get(tq: TransferQueue, payload: dict, batch_size: int, reps: int) -> list[float]:
    rows = len(payload["input_ids"])

    def run(i: int) -> float:
        partition = f"bench-claim-{batch_size}-{i}"
        tq.create_partition(partition)
        tq.put(partition, payload)
        start = time.perf_counter()
        consume(tq, partition, batch_size, rows)
        seconds = time.perf_counter() - start
        tq.clear_partition(partition)
        return seconds

    return timed_runs(run, reps)


def wait_registered(stack: LocalTransferQueue) -> None:
    """LocalTransferQueue returns once a shard answers health for "", which can precede its
    registration with the controller (then create_partition fails: no shard registered)."""
    for proc, address in zip(stack.shards, stack.shard_addresses):
        proc.wait_until(lambda: grpc_serving(address, SHARD_HEALTH), 30)


def verify_roundtrip(tq: TransferQueue, payload: dict) -> None:
    """One untimed put + get of everything, compared bit for bit (also warms every path up)."""
    partition = "bench-verify"
    tq.create_partition(partition)
    rows = tq.put(partition, payload)
    batch = tq.get(partition, rows, FIELDS)
    for name in FIELDS:
        if not torch.equal(batch[name], payload[name]):
            raise RuntimeError(f"field {name} did not survive a put/get round trip")
    tq.clear_partition(partition)


# ---------------------------------------------------------------------------------- claim latency


def claim_latencies(tq: TransferQueue, partition: str, warmup: int, iters: int) -> np.ndarray:
    """Seconds per 1-row claim_rows (the ack after each claim is not timed)."""
    out = np.empty(iters)
    for i in range(warmup + iters):
        start = time.perf_counter()
        claimed = tq.claim_rows(partition, LAT_TASK, 1)
        seconds = time.perf_counter() - start
        if len(claimed.rows) != 1:
            raise RuntimeError(f"1-row claim on {partition} returned {len(claimed.rows)} rows")
        tq.ack(claimed.lease_id)
        if i >= warmup:
            out[i - warmup] = seconds
    return out


def latency_run(tq: TransferQueue, partition: str, warmup: int, iters: int) -> dict:
    tq.create_partition(partition)
    tq.put(partition, {LAT_FIELD: torch.arange(warmup + iters, dtype=torch.int64)})
    summary = latency_summary(claim_latencies(tq, partition, warmup, iters))
    tq.clear_partition(partition)
    return summary


def waiting_claims(metrics_url: str) -> float:
    """The controller's sluice_tq_waiting_claims gauge (claims parked in a long-poll)."""
    with urllib.request.urlopen(metrics_url, timeout=2) as res:
        for line in res.read().decode().splitlines():
            if line.startswith("sluice_tq_waiting_claims "):
                return float(line.split()[1])
    return 0.0


def start_blocker(controller: str, metrics_url: str, log_dir: str) -> ChildProcess:
    """A second client process parked in a claim that never gets data; returns once it is parked."""
    proc = ChildProcess(
        "blocker", [sys.executable, SELF, "--blocker", controller], os.path.join(log_dir, "blocker.log")
    )
    try:
        proc.wait_until(lambda: waiting_claims(metrics_url) >= 1, 60)
    except BaseException:
        proc.stop()
        raise
    return proc


def bench_latency(tq: TransferQueue, controller: str, metrics_url: str, warmup: int, iters: int, log_dir: str) -> dict:
    out = {"idle": latency_run(tq, "bench-latency-idle", warmup, iters)}
    log(f"claim latency, no other client: {out['idle']}")
    tq.create_partition(BLOCK_PARTITION, exist_ok=True)
    blocker = start_blocker(controller, metrics_url, log_dir)
    try:
        out["with_waiting_client"] = latency_run(tq, "bench-latency-contended", warmup, iters)
        if not blocker.alive() or waiting_claims(metrics_url) < 1:
            raise RuntimeError(f"the waiting client stopped waiting during the run; log: {blocker.log_tail()}")
    finally:
        blocker.stop()
    log(f"claim latency, one client waiting: {out['with_waiting_client']}")
    return out


def run_blocker(controller: str) -> int:
    """--blocker: park in a long-poll claim forever (the controller caps a wait at max_wait_ms)."""
    with TransferQueue(controller) as tq:
        while True:
            claimed = tq.claim_rows(BLOCK_PARTITION, BLOCK_TASK, 1, wait_s=3600)
            if claimed.rows:
                raise SystemExit(f"blocker unexpectedly claimed rows {claimed.rows}")


# ---------------------------------------------------------------------------------- time to ready


def time_to_serving(name: str, argv: list[str], address: str, service: str, log_path: str) -> float:
    """Spawn, wait for health SERVING, stop; -> seconds from spawn to SERVING."""
    start = time.perf_counter()
    proc = ChildProcess(name, argv, log_path)
    try:
        proc.wait_until(lambda: grpc_serving(address, service), 30)
        return time.perf_counter() - start
    finally:
        proc.stop()


def controller_argv(port: int, redis_url: str) -> list[str]:
    return sluice_argv("tq-controller", "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url)


def shard_argv(port: int, shard_id: str, controller: str) -> list[str]:
    return sluice_argv(
        "tq-shard",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--advertise-host",
        "127.0.0.1",
        "--shard-id",
        shard_id,
        "--controller",
        controller,
    )


def bench_ready(reps: int, log_dir: str) -> dict:
    redis, redis_url = start_redis(log_dir=log_dir)
    controller = None
    try:
        controller_s = []
        for i in range(reps):
            port = free_port()
            controller_s.append(
                time_to_serving(
                    "tq-controller",
                    controller_argv(port, redis_url),
                    f"127.0.0.1:{port}",
                    CONTROLLER_HEALTH,
                    os.path.join(log_dir, f"ready-controller-{i}.log"),
                )
            )
        port = free_port()
        address = f"127.0.0.1:{port}"
        controller = ChildProcess(
            "tq-controller", controller_argv(port, redis_url), os.path.join(log_dir, "ready-controller.log")
        )
        controller.wait_until(lambda: grpc_serving(address, CONTROLLER_HEALTH), 30)
        shard_s = []
        for i in range(reps):
            shard_port = free_port()
            shard_s.append(
                time_to_serving(
                    f"tq-shard {i}",
                    shard_argv(shard_port, f"ready-{i}", address),
                    f"127.0.0.1:{shard_port}",
                    SHARD_HEALTH,
                    os.path.join(log_dir, f"ready-shard-{i}.log"),
                )
            )
        return {"controller": median_summary(controller_s), "shard": median_summary(shard_s)}
    finally:
        if controller:
            controller.stop()
        redis.stop()


# ---------------------------------------------------------------------------------- raw gRPC baseline


def chunked(data: memoryview):
    for start in range(0, len(data), CHUNK_BYTES):
        yield data[start : start + CHUNK_BYTES].tobytes()


async def _serve_raw(port: int) -> None:
    held: dict[str, bytes] = {}

    async def put(request_iterator, context):
        held["data"] = b"".join([chunk async for chunk in request_iterator])
        return len(held["data"]).to_bytes(8, "little")

    async def get(request, context):
        if "data" not in held:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "put something first")
        for chunk in chunked(memoryview(held["data"])):
            yield chunk

    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                RAW_SERVICE,
                {"Put": grpc.stream_unary_rpc_method_handler(put), "Get": grpc.unary_stream_rpc_method_handler(get)},
            ),
        )
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def run_raw_server(port: int) -> int:
    """--raw-server: identity-serialized bytes in (client stream) and out (server stream)."""
    asyncio.run(_serve_raw(port))
    return 0


def bench_raw(payload: dict, reps: int, log_dir: str) -> dict:
    data = memoryview(b"".join(t.numpy().tobytes() for t in payload.values()))
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = ChildProcess(
        "raw-grpc-server", [sys.executable, SELF, "--raw-server", str(port)], os.path.join(log_dir, "raw-server.log")
    )
    try:
        server.wait_until(lambda: grpc_serving(address), 60)
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            put = channel.stream_unary(f"/{RAW_SERVICE}/Put")
            get = channel.unary_stream(f"/{RAW_SERVICE}/Get")

            def run_put(_: int) -> float:
                start = time.perf_counter()
                stored = int.from_bytes(put(chunked(data)), "little")
                seconds = time.perf_counter() - start
                if stored != len(data):
                    raise RuntimeError(f"raw put stored {stored} of {len(data)} bytes")
                return seconds

            def run_get(_: int) -> float:
                start = time.perf_counter()
                received = b"".join(get(b""))
                seconds = time.perf_counter() - start
                if len(received) != len(data):
                    raise RuntimeError(f"raw get returned {len(received)} of {len(data)} bytes")
                return seconds

            rows = len(payload["input_ids"])
            return {
                "bytes": len(data),
                "chunk_bytes": CHUNK_BYTES,
                "put": throughput(timed_runs(run_put, reps), len(data), rows),
                "get": throughput(timed_runs(run_get, reps), len(data), rows),
            }
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- report


def verdicts(result: dict) -> dict:
    put = result["put"]["single_call"]["mb_per_s"]
    get = result["claim_get"]["single_claim"]["mb_per_s"]
    lat = result["claim_latency_ms"]
    ready = result["ready_s"]
    out = {"put_mb_per_s": put >= TARGETS["put_mb_per_s_min"], "get_mb_per_s": get >= TARGETS["get_mb_per_s_min"]}
    for case, summary in lat.items():
        out[f"claim_p50_{case}"] = summary["p50_ms"] <= TARGETS["claim_p50_ms_max"]
        out[f"claim_p99_{case}"] = summary["p99_ms"] <= TARGETS["claim_p99_ms_max"]
    for proc, summary in ready.items():
        out[f"ready_{proc}"] = summary["median_s"] <= TARGETS["ready_s_max"]
    out["all"] = all(out.values())
    return out


def ratios(result: dict) -> dict:
    raw = result["raw_grpc"]
    return {
        "put_tq_over_raw": round(result["put"]["single_call"]["mb_per_s"] / raw["put"]["mb_per_s"], 3),
        "get_tq_over_raw": round(result["claim_get"]["single_claim"]["mb_per_s"] / raw["get"]["mb_per_s"], 3),
    }


def config(args, rows: int, nbytes: int) -> dict:
    return {
        "rows": rows,
        "row_len": ROW_LEN,
        "fields": {"input_ids": "int64", "log_probs": "float32"},
        "payload_bytes": nbytes,
        "payload_mb": round(nbytes / 1e6, 2),
        "small_batch_rows": SMALL_BATCH,
        "shards": 1,
        "chunk_bytes": CHUNK_BYTES,
        "reps": args.reps,
        "latency_iters": args.latency_iters,
        "latency_warmup": args.latency_warmup,
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "torch": torch.__version__,
    }


def bench_stack(payload: dict, args, log_dir: str) -> dict:
    """put, claim_get and claim_latency_ms against a fresh LocalTransferQueue with one shard."""
    rows, nbytes = len(payload["input_ids"]), payload_nbytes(payload)
    metrics_port = free_port()
    controller_args = ("--metrics-port", str(metrics_port))  # for the sluice_tq_waiting_claims gauge
    out: dict = {}
    with (
        LocalTransferQueue(shards=1, log_dir=log_dir, controller_args=controller_args) as stack,
        TransferQueue(stack.controller_address) as tq,
    ):
        wait_registered(stack)
        tq.register_task(TASK, FIELDS)
        tq.register_task(LAT_TASK, [LAT_FIELD])
        tq.register_task(BLOCK_TASK, ["never-produced"])
        verify_roundtrip(tq, payload)
        out["put"] = {
            "single_call": throughput(bench_put(tq, payload, rows, args.reps), nbytes, rows),
            f"batches_of_{SMALL_BATCH}": throughput(bench_put(tq, payload, SMALL_BATCH, args.reps), nbytes, rows),
        }
        log(f"put: {out['put']}")
        out["claim_get"] = {
            "single_claim": throughput(bench_claim_get(tq, payload, rows, args.reps), nbytes, rows),
            f"claims_of_{SMALL_BATCH}": throughput(bench_claim_get(tq, payload, SMALL_BATCH, args.reps), nbytes, rows),
        }
        log(f"claim+get: {out['claim_get']}")
        out["claim_latency_ms"] = bench_latency(
            tq,
            stack.controller_address,
            f"http://127.0.0.1:{metrics_port}/metrics",
            args.latency_warmup,
            args.latency_iters,
            log_dir,
        )
    return out


def run_benchmark(args) -> dict:
    torch.set_num_threads(1)
    log_dir = tempfile.mkdtemp(prefix="sluice-bench-")
    log(f"logs in {log_dir}")
    payload = make_payload(512 if args.quick else 4096)
    result: dict = {"config": config(args, len(payload["input_ids"]), payload_nbytes(payload))}
    result["ready_s"] = bench_ready(args.reps, log_dir)
    log(f"time to ready: {result['ready_s']}")
    result["raw_grpc"] = bench_raw(payload, args.reps, log_dir)
    log(f"raw gRPC: put {result['raw_grpc']['put']['mb_per_s']} MB/s, get {result['raw_grpc']['get']['mb_per_s']} MB/s")
    result.update(bench_stack(payload, args, log_dir))
    result["ratios"] = ratios(result)
    result["targets"] = TARGETS
    result["meets_targets"] = verdicts(result)
    result["elapsed_s"] = round(time.perf_counter() - _T0, 1)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=None, help="timed runs per figure (default 5; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 512 rows, fewer repetitions and iterations")
    p.add_argument("--latency-iters", type=int, default=None, help="timed 1-row claims per case (default 2000)")
    p.add_argument("--latency-warmup", type=int, default=200, help="untimed 1-row claims before those")
    p.add_argument("--raw-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--blocker", metavar="CONTROLLER", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.latency_iters is None:
        args.latency_iters = 200 if args.quick else 2000
    if args.reps < 1 or args.latency_iters < 1:
        p.error("--reps and --latency-iters must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.raw_server:
        return run_raw_server(args.raw_server)
    if args.blocker:
        return run_blocker(args.blocker)
    print(json.dumps(run_benchmark(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
