"""TransferQueue load test: prints one JSON object to stdout (progress goes to stderr).

Each concurrency level (8, 32, 128 clients) gets a FRESH local stack (private redis-server, one controller,
--shards storage shards, each its own process), so each level's peak memory is its own. The clients run
--duration-s (60 s; 5 with --quick), spread over --procs client processes (2: one Python process cannot drive
128 clients on 2 cores). Every client is its own AsyncTransferQueue, as separate rollout workers or trainer
ranks would be (gRPC shares one TCP connection per address within a process: the servers see --procs
connections). Closed loop: each client's next call follows the last at once, so the servers are saturated
and latencies include queueing behind the other clients.

Workload, per client process: half its clients (rounded up) produce, half consume, on the process's own
stream of partitions, as a trainer does per step:
  producer  put 16 rows of input_ids int64[256] (32 KiB) into the current partition, again and again; each
            row holds one unique value in all 256 slots, so every read is checked.
  consumer  claim(batch_size=32, wait_s=0.1: a long poll) on the oldest unfinished partition, check, ack.
  rotation  every --epoch-s (5 s) the next partition is created and producers switch to it; the previous
            one is sealed once its in-flight puts are done, and cleared once a claim reports it complete
            and no claim on it is in flight (shard memory stays bounded, as in a real run). At the end
            producers stop, the last partition is sealed and consumers drain everything (within 60 s).

Measured per level (one run each, no repetitions or medians: a load/robustness test, no baseline):
  claims, puts       claims that returned rows, puts that succeeded; empty_claims: long polls without rows.
  claim_latency_ms   p50/p99/max of claims that returned rows: claim call until the rows are in hand (claim
                     RPC + reading the bytes from the shard; up to 0.1 s of long poll when the consumer had
                     to wait for a put); claim_read_ms: the read part alone. put_latency_ms likewise
                     per put (PreparePut, bytes to the shard, CommitPut).
  rows_per_s         rows acked during the timed window / window length (the drain not counted);
                     rows_moved: rows acked in all, drain included (must equal rows_put).
  errors             every exception a call raised, by operation and gRPC status code (or exception type),
                     plus lost_rows, duplicate_rows, corrupt_rows, unexpected_rows, drain_timeout and
                     server_died. errors_total must be 0 ("ok").
  peak_rss_mib       VmHWM (the kernel's peak resident set, /proc/PID/status) of the controller, the largest
                     shard (each in peak_rss_mib_shards) and redis-server; end_rss_mib: VmRSS after
                     the drain, when every partition is cleared.
  cpu_cores_used     CPU seconds / wall seconds of the level, per server and for all client processes
                     together (start-up and drain included): which process saturates the 2 cores.

Usage: python benchmarks/tq_load.py [--quick] [--clients 8,32,128] [--duration-s 60] [--procs 2] [--shards 1]
The client processes run benchmarks/tq_load_client.py.
"""

from __future__ import annotations

import os

# one torch/BLAS thread, set before torch loads (client processes inherit it as well)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from services.runtime.processes import ChildProcess  # noqa: E402
from services.transferqueue.client.queue import TransferQueue  # noqa: E402
from services.transferqueue.local_stack import LocalTransferQueue, grpc_serving  # noqa: E402

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tq_load_client.py")
sys.path.insert(0, os.path.dirname(CLIENT))  # the sibling client module: its workload constants
from tq_load_client import CLAIM_ROWS, CLAIM_WAIT_S, DRAIN_S, FIELD, PUT_ROWS, ROW_LEN, TASK  # noqa: E402

SHARD_HEALTH = "sluice.transferqueue.v1.StorageShard"  # SERVING only once registered with the controller

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- driver


def status_mib(pid: int, key: str) -> float:
    """VmHWM: the kernel's peak resident set of the process (no sampling can miss the peak); VmRSS: now."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no {key} for pid {pid}")


def cpu_s(pid: int) -> float:
    """utime + stime of the process so far (/proc/PID/stat fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(servers: dict) -> dict:
    return {k: sum(cpu_s(p.proc.pid) for p in procs if p.alive()) for k, procs in servers.items()}


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def start_workers(n_clients: int, args, controller: str, sync_dir: str) -> list[ChildProcess]:
    workers = []
    # at least 2 clients per process: each process's stream needs a producer and a consumer
    for wid, n in enumerate(split(n_clients, max(1, min(args.procs, n_clients // 2)))):
        producers = (n + 1) // 2
        argv = [
            sys.executable,
            CLIENT,
            controller,
            "--worker-id",
            str(wid),
            "--producers",
            str(producers),
            "--consumers",
            str(n - producers),
            "--duration-s",
            str(args.duration_s),
            "--epoch-s",
            str(args.epoch_s),
            "--sync-dir",
            sync_dir,
        ]
        workers.append(ChildProcess(f"client process {wid}", argv, os.path.join(sync_dir, f"worker-{wid}.log")))
    return workers


def run_workers(workers: list[ChildProcess], args, sync_dir: str) -> list[dict]:
    ready = [os.path.join(sync_dir, f"ready-{i}") for i in range(len(workers))]
    for w, path in zip(workers, ready):
        w.wait_until(lambda: os.path.exists(path), 120)
    with open(os.path.join(sync_dir, "go.tmp"), "w") as f:
        f.write(repr(time.time() + 0.2))
    os.rename(os.path.join(sync_dir, "go.tmp"), os.path.join(sync_dir, "go"))  # atomic: never read half-written
    deadline = time.monotonic() + args.duration_s + DRAIN_S + 60
    for w in workers:
        w.proc.wait(max(1.0, deadline - time.monotonic()))
        if w.proc.returncode != 0:
            raise RuntimeError(f"{w.name} exited with {w.proc.returncode}; log: {w.log_tail()}")
    results = []
    for i in range(len(workers)):
        with open(os.path.join(sync_dir, f"result-{i}.json")) as f:
            results.append(json.load(f))
    return results


def percentiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"n": 0}
    ms = np.asarray(seconds) * 1e3
    return {
        "n": int(len(ms)),
        "p50": round(float(np.percentile(ms, 50)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
        "max": round(float(ms.max()), 3),
    }


def merge(n_clients: int, results: list[dict], duration_s: float) -> dict:
    counts, errors = collections.Counter(), collections.Counter()
    for r in results:
        counts.update(r["counts"])
        errors.update(r["errors"])
    window_s = max(r["window_s"] for r in results)
    rows_put = sum(r["rows_put"] for r in results)
    rows_acked = sum(r["rows_acked"] for r in results)
    return {
        "clients": n_clients,
        "client_procs": len(results),
        "producers": sum(r["producers"] for r in results),
        "consumers": sum(r["consumers"] for r in results),
        "duration_s": duration_s,
        "window_s": round(window_s, 2),
        "claims": counts["claims"],
        "empty_claims": counts["empty_claims"],
        "puts": counts["puts"],
        "rows_put": rows_put,
        "rows_moved": rows_acked,
        "rows_per_s": round(counts["rows_acked_in_window"] / duration_s, 1),
        "claim_latency_ms": percentiles_ms([s for r in results for s in r["claim_s"]]),
        "claim_read_ms": percentiles_ms([s for r in results for s in r["read_s"]]),
        "put_latency_ms": percentiles_ms([s for r in results for s in r["put_s"]]),
        "errors": {"count": sum(errors.values()), "by_kind": dict(sorted(errors.items()))},
        "error_samples": [s for r in results for s in r["error_samples"]][:10],
    }


def run_level(n_clients: int, args, log_dir: str) -> dict:
    level_dir = os.path.join(log_dir, f"clients-{n_clients}")
    os.makedirs(level_dir)
    with LocalTransferQueue(shards=args.shards, log_dir=level_dir) as stack:
        for proc, address in zip(stack.shards, stack.shard_addresses):
            proc.wait_until(lambda: grpc_serving(address, SHARD_HEALTH), 30)
        with TransferQueue(stack.controller_address) as tq:
            tq.register_task(TASK, [FIELD])
        servers = {"controller": [stack.controller], "shard": stack.shards, "redis": [stack.redis]}
        cpu0, wall0 = server_cpu(servers), time.perf_counter()
        workers = start_workers(n_clients, args, stack.controller_address, level_dir)
        try:
            results = run_workers(workers, args, level_dir)
        finally:
            for w in workers:
                w.stop()
        out = merge(n_clients, results, args.duration_s)
        # CPU of each server over the level (client start-up and drain included): who saturates 2 cores
        wall, cpu1 = time.perf_counter() - wall0, server_cpu(servers)
        out["cpu_cores_used"] = {k: round(max(0.0, cpu1[k] - cpu0[k]) / wall, 2) for k in servers}
        out["cpu_cores_used"]["clients"] = round(sum(r["cpu_s"] for r in results) / wall, 2)
        died = [p.name for procs in servers.values() for p in procs if not p.alive()]
        if died:
            out["errors"]["by_kind"]["server_died"] = len(died)
            out["errors"]["count"] += len(died)
            out["error_samples"].append(f"server processes gone: {died}")
        rss = {k: [status_mib(p.proc.pid, "VmHWM") for p in procs if p.alive()] for k, procs in servers.items()}
        out["peak_rss_mib"] = {k: max(v, default=None) for k, v in rss.items()}
        out["peak_rss_mib_shards"] = rss["shard"]
        # after the drain every partition is cleared: what a server still holds then is not data
        out["end_rss_mib"] = {
            k: max((status_mib(p.proc.pid, "VmRSS") for p in procs if p.alive()), default=None)
            for k, procs in servers.items()
        }
        out["logs"] = level_dir
    return out


def config(args) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return {
        "clients": args.clients,
        "duration_s": args.duration_s,
        "client_procs": args.procs,
        "shards": args.shards,
        "epoch_s": args.epoch_s,
        "put_rows": PUT_ROWS,
        "claim_rows": CLAIM_ROWS,
        "claim_wait_s": CLAIM_WAIT_S,
        "row": f"{FIELD} int64[{ROW_LEN}]",
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
    }


def run_benchmark(args) -> dict:
    log_dir = tempfile.mkdtemp(prefix="sluice-load-")
    log(f"logs in {log_dir}")
    levels = []
    for n in args.clients:
        log(f"{n} clients for {args.duration_s}s ...")
        level = run_level(n, args, log_dir)
        log(
            f"{n} clients: {level['rows_per_s']} rows/s, claim p50/p99 {level['claim_latency_ms'].get('p50')}/"
            f"{level['claim_latency_ms'].get('p99')} ms, errors {level['errors']['count']}, "
            f"peak RSS MiB {level['peak_rss_mib']}"
        )
        levels.append(level)
    errors_total = sum(level["errors"]["count"] for level in levels)
    return {
        "config": config(args),
        "levels": levels,
        "errors_total": errors_total,
        "ok": errors_total == 0,
        "elapsed_s": round(time.perf_counter() - _T0, 1),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", default="8,32,128", help="comma-separated concurrency levels")
    p.add_argument("--duration-s", type=float, default=None, help="seconds per level (default 60; 5 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 5 s per level")
    p.add_argument("--procs", type=int, default=2, help="client processes the clients are spread over")
    p.add_argument("--shards", type=int, default=1, help="storage shards of the stack")
    p.add_argument("--epoch-s", type=float, default=None, help="partition rotation (default 5; 2 with --quick)")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in str(args.clients).split(",") if c.strip()]
    args.duration_s = args.duration_s or (5.0 if args.quick else 60.0)
    args.epoch_s = args.epoch_s or (2.0 if args.quick else 5.0)
    if not args.clients or min(args.clients) < 2 or args.procs < 1 or args.shards < 1 or args.duration_s <= 0:
        p.error("--clients needs levels >= 2 (one producer and one consumer); --procs, --shards >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run_benchmark(args)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
