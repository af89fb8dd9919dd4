"""Weight-sync benchmark: prints one JSON object to stdout (progress goes to stderr).

Workload: a Llama-shaped dict of float32 named tensors (embed_tokens, L layers of q/k/v/o/gate/up/down
+ two norms, final norm, lm_head) of ~100M parameters (~400 MB; ~10M with --quick), synced from ONE
trainer process to TWO receiver processes over gloo on loopback, with a private redis-server and the
DCS coordinator (LocalDCS) as their own processes. Every process runs with one torch/BLAS thread.

    trainer   : registers with DCS (role trainer), WeightPublisher.publish(tensors, version)
    receivers : register (role actor_fwd), WeightReceiver.declare(); per version next() -> receive()
                (fresh buffers) -> sha256 of every received tensor -> loaded(published, 0.0)

Steps are run in lock-step: before every step the three workers meet at a barrier (a 1-element
allreduce on a separate "control" BroadcastGroup), so no step is timed while a worker is still busy
with the previous one (verification, digests). Digests are computed outside all timings.

Measured (GB = 1e9 bytes; every figure is the median over the counted reps; one warm-up is dropped):
  headline  Sluice sync with the publisher's default bucket (64 MiB): the trainer's SyncResult
            seconds {metadata, pack, broadcast, total}, effective GB/s = SyncResult.bytes / total;
            the receivers' side: next() (metadata long-poll) and receive() wall time as measured
            around the calls, and receive()'s own phases as reported to DCS (GET /v1/runs/{run}/syncs);
            end_to_end = trainer's publish start -> the last receiver's receive() returned
            (CLOCK_MONOTONIC is shared by all processes).
  raw       the transport's limit: ONE flat uint8 tensor of the same number of bytes broadcast from
            the trainer (rank 0) in the control group (BroadcastGroup.open, i.e. a ProcessGroupGloo
            built exactly as the sync groups are) with preallocated, already touched buffers;
            raw_fresh the same with the receivers allocating a fresh buffer every time (as
            WeightReceiver.receive does). Raw, raw_fresh and headline reps are interleaved.
  ratio     headline GB/s / raw GB/s (trainer side; target >= 0.8), and the same end to end.
  sweep     the headline measurement for bucket sizes 16, 64, 256 MiB (--sweep-reps each, default 3).
  verified  every sync (warm-ups included): both receivers got version V with the sha256 of all
            tensors equal to the trainer's (the trainer stamps model.norm.weight with V each sync).
  host      single-thread memcpy GB/s into a fresh vs. an already touched destination (page-fault
            cost on this machine; both pack and receive write into fresh buffers).

Usage: python benchmarks/weight_sync.py [--quick] [--params 100e6] [--reps 5] [--sweep-reps 3]
Internal mode (child processes of the benchmark): --worker trainer|receiver --plan FILE ...
"""

from __future__ import annotations

import os

# one torch/BLAS thread, set before torch loads its thread pools (children inherit it as well)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

from services.dcs.client import DCSClient  # noqa: E402
from services.dcs.local import LocalDCS  # noqa: E402
from services.dcs.models import Heartbeat, NodeRegistration  # noqa: E402
from services.dcs.sync.groups import BroadcastGroup  # noqa: E402
from services.dcs.sync.layout import plan_buckets  # noqa: E402
from services.dcs.sync.publisher import WeightPublisher  # noqa: E402
from services.dcs.sync.receiver import WeightReceiver  # noqa: E402
from services.runtime.processes import ChildProcess, free_port  # noqa: E402

SELF = os.path.abspath(__file__)
MIB = 1 << 20
RECEIVERS = 2
RUN_ID = "bench-wsync"
ROLE = "actor_fwd"  # a flat-bucket receiver ("engine" members are driven through the SGLang protocol)
STAMP = "model.norm.weight"  # filled with the version number before every sync
TARGET_RATIO = 0.8

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- model


def model_shapes(params: float) -> tuple[list[tuple[str, list[int]]], dict]:
    """HF Llama names and shapes summing to ~params: hidden 768 / vocab 32000 from 50M up,
    hidden 256 / vocab 8192 below; the layer count fills the rest."""
    hidden, vocab = (768, 32000) if params >= 50e6 else (256, 8192)
    inter = -(-int(hidden * 8 / 3) // 64) * 64
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
    shapes: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "self_attn.q_proj.weight", [hidden, hidden]),
            (p + "self_attn.k_proj.weight", [hidden, hidden]),
            (p + "self_attn.v_proj.weight", [hidden, hidden]),
            (p + "self_attn.o_proj.weight", [hidden, hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "mlp.gate_proj.weight", [inter, hidden]),
            (p + "mlp.up_proj.weight", [inter, hidden]),
            (p + "mlp.down_proj.weight", [hidden, inter]),
        ]
    shapes += [(STAMP, [hidden]), ("lm_head.weight", [vocab, hidden])]
    numel = sum(_numel(s) for _, s in shapes)
    return shapes, {
        "hidden": hidden,
        "intermediate": inter,
        "vocab": vocab,
        "layers": layers,
        "tensors": len(shapes),
        "params": numel,
        "bytes": numel * 4,
        "dtype": "float32",
    }


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_model(shapes) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, raw bytes) of every tensor in name order, without copying."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# ---------------------------------------------------------------------------------- plan


def make_plan(reps: int, sweep_reps: int, headline_mib: int, sweep_mib: list[int]) -> list[dict]:
    """The steps every worker runs, in order (all workers read the same plan)."""
    steps: list[dict] = []
    version = 0

    def add(**step):
        steps.append({"step": len(steps), **step})

    for i in range(reps + 1):  # i = 0: warm-up of each kind
        add(kind="raw", phase="raw", fresh=False, counted=i > 0)
        add(kind="raw", phase="raw_fresh", fresh=True, counted=i > 0)
        version += 1
        add(kind="sync", phase="headline", bucket_mib=headline_mib, version=version, counted=i > 0)
    for mib in sweep_mib:
        for i in range(sweep_reps + 1):
            version += 1
            add(kind="sync", phase=f"sweep_{mib}", bucket_mib=mib, version=version, counted=i > 0)
    return steps


# ---------------------------------------------------------------------------------- workers


def barrier(ctrl: BroadcastGroup) -> None:
    work = ctrl.pg.allreduce([torch.zeros(1)])
    work.wait()


def heartbeats(dcs_url: str, node_id: str, stop: threading.Event) -> None:
    with DCSClient(dcs_url) as dcs:
        while not stop.is_set():
            try:
                dcs.heartbeat(node_id, Heartbeat())
            except Exception:
                pass
            stop.wait(0.5)


def run_worker(args) -> int:
    plan = json.load(open(args.plan))
    steps, nbytes, timeout_s = plan["steps"], plan["model"]["bytes"], plan["timeout_s"]
    out = open(args.out, "a", buffering=1)

    def emit(**event):
        out.write(json.dumps(event) + "\n")

    trainer = args.worker == "trainer"
    dcs = DCSClient(plan["dcs"])
    node = dcs.register(NodeRegistration(role="trainer" if trainer else ROLE, host="127.0.0.1", run_id=RUN_ID))
    stop = threading.Event()
    threading.Thread(target=heartbeats, args=(plan["dcs"], node.node_id, stop), daemon=True).start()
    rank = 0 if trainer else args.index + 1

    if trainer:
        tensors = make_model(plan["shapes"])
        raw_buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    else:
        receiver = WeightReceiver(dcs, node.node_id, ROLE, timeout_s=timeout_s, run_id=RUN_ID)
        receiver.declare()
        raw_buf = torch.zeros(nbytes, dtype=torch.uint8)  # preallocated and touched
    ctrl = BroadcastGroup.open("bench-ctrl", "gloo", "127.0.0.1", plan["ctrl_port"], rank, 1 + RECEIVERS, timeout_s)
    barrier(ctrl)  # everyone registered (receivers declared) and connected
    emit(event="ready", node_id=node.node_id, rank=rank, pid=os.getpid())

    if trainer:
        deadline = time.monotonic() + 30
        while sum(n.alive for n in dcs.topology().roles.get(ROLE, []) if n.run_id == RUN_ID) < RECEIVERS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"receivers did not show up as alive {ROLE} nodes in DCS")
            time.sleep(0.05)
        publisher = WeightPublisher(
            dcs, node.node_id, "127.0.0.1", timeout_s=timeout_s, receiver_roles=[ROLE], run_id=RUN_ID
        )
    received: dict[str, torch.Tensor] | None = None

    for step in steps:
        base = {"step": step["step"], "phase": step["phase"], "counted": step["counted"]}
        if step["kind"] == "raw":
            buf = raw_buf if (trainer or not step["fresh"]) else torch.empty(nbytes, dtype=torch.uint8)
            barrier(ctrl)
            t0 = time.monotonic()
            ctrl.broadcast(buf, 0)
            t1 = time.monotonic()
            emit(event="raw", **base, t0=t0, t1=t1, seconds=t1 - t0, bytes=nbytes)
            del buf
            continue

        version = step["version"]
        if trainer:
            tensors[STAMP].fill_(float(version))
            publisher.bucket_bytes = step["bucket_mib"] * MIB
            _, sizes = plan_buckets(list(tensors.items()), publisher.bucket_bytes)
            d = digest(tensors)
            barrier(ctrl)
            t0 = time.monotonic()
            res = publisher.publish(tensors.items(), version)
            t1 = time.monotonic()
            emit(
                event="sync",
                **base,
                version=version,
                bucket_mib=step["bucket_mib"],
                buckets=len(sizes),
                t0=t0,
                t1=t1,
                wall_s=t1 - t0,
                seconds=res.seconds,
                bytes=res.bytes,
                group=res.group,
                world_size=res.world_size,
                digest=d,
            )
        else:
            received = None  # the previous version is dropped (swapped into a model) before the next arrives
            barrier(ctrl)
            t0 = time.monotonic()
            published = None
            while published is None:
                published = receiver.next(wait_s=timeout_s)
            t1 = time.monotonic()
            received = receiver.receive(published)
            t2 = time.monotonic()
            d = digest(received)
            receiver.loaded(published, 0.0)  # nothing is loaded into a model here (load phase = 0)
            emit(
                event="sync",
                **base,
                version=published.version,
                expected_version=version,
                t0=t0,
                t_meta=t1,
                t1=t2,
                next_s=t1 - t0,
                receive_s=t2 - t1,
                bytes=sum(published.bucket_bytes),
                group=published.sync_group.name if published.sync_group else None,
                digest=d,
            )
    barrier(ctrl)
    emit(event="done")
    if trainer:
        publisher.close()
    else:
        receiver.close()
    ctrl.close()
    stop.set()
    dcs.close()
    return 0


# ---------------------------------------------------------------------------------- statistics


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rnd(x, n=4):
    return None if x is None else round(x, n)


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else round(nbytes / seconds / 1e9, 3)


def read_events(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def summarize_raw(phase: str, trainer: list[dict], receivers: list[list[dict]]) -> dict:
    rows = [e for e in trainer if e["event"] == "raw" and e["phase"] == phase and e["counted"]]
    recv = {(i, e["step"]): e for i, evs in enumerate(receivers) for e in evs if e["event"] == "raw"}
    nbytes = rows[0]["bytes"]
    trainer_s = [e["seconds"] for e in rows]
    e2e = [max(recv[(i, e["step"])]["t1"] for i in range(len(receivers))) - e["t0"] for e in rows]
    recv_s = [max(recv[(i, e["step"])]["seconds"] for i in range(len(receivers))) for e in rows]
    return {
        "reps": len(rows),
        "bytes": nbytes,
        "gb_per_s": gbps(nbytes, med(trainer_s)),
        "seconds": rnd(med(trainer_s)),
        "receivers_seconds_max": rnd(med(recv_s)),
        "end_to_end_s": rnd(med(e2e)),
        "end_to_end_gb_per_s": gbps(nbytes, med(e2e)),
        "runs_s": [rnd(s) for s in trainer_s],
    }


def summarize_sync(phase: str, trainer: list[dict], receivers: list[list[dict]], reports: dict) -> dict:
    rows = [e for e in trainer if e["event"] == "sync" and e["phase"] == phase and e["counted"]]
    recv = {(i, e["expected_version"]): e for i, evs in enumerate(receivers) for e in evs if e["event"] == "sync"}
    nbytes = rows[0]["bytes"]
    seconds = {k: rnd(med(e["seconds"].get(k) for e in rows)) for k in ("metadata", "pack", "broadcast", "total")}
    total = med(e["seconds"]["total"] for e in rows)
    per_rep_recv = [[recv[(i, e["version"])] for i in range(len(receivers))] for e in rows]
    e2e = [max(r["t1"] for r in rs) - e["t0"] for e, rs in zip(rows, per_rep_recv)]
    rep_dcs = {}
    for k in ("metadata", "broadcast", "total"):  # receive()'s own phases, as each receiver reported them
        vals = []
        for e in rows:
            xs = [reports.get((e["version"], nid), {}).get(k) for nid in reports["_receivers"]]
            if all(x is not None for x in xs):
                vals.append(max(xs))
        rep_dcs[k] = rnd(med(vals))
    return {
        "reps": len(rows),
        "versions": [e["version"] for e in rows],
        "bucket_mib": rows[0]["bucket_mib"],
        "buckets": rows[0]["buckets"],
        "bytes": nbytes,
        "gb_per_s": gbps(nbytes, total),
        "trainer_seconds": seconds,
        "trainer_wait_for_pack_s": rnd(
            med(e["seconds"]["total"] - e["seconds"]["metadata"] - e["seconds"]["broadcast"] for e in rows)
        ),
        "receivers": {
            "next_s_max": rnd(med(max(r["next_s"] for r in rs) for rs in per_rep_recv)),
            "receive_s_max": rnd(med(max(r["receive_s"] for r in rs) for rs in per_rep_recv)),
            "reported_to_dcs_max": rep_dcs,
        },
        "end_to_end_s": rnd(med(e2e)),
        "end_to_end_gb_per_s": gbps(nbytes, med(e2e)),
        "runs_total_s": [rnd(e["seconds"]["total"]) for e in rows],
    }


def copy_bandwidth(nbytes: int) -> dict:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    t = time.perf_counter()
    dst.copy_(src)
    fresh = time.perf_counter() - t
    t = time.perf_counter()
    dst.copy_(src)
    warm = time.perf_counter() - t
    return {
        "bytes": nbytes,
        "fresh_dst_gb_per_s": gbps(nbytes, fresh),
        "touched_dst_gb_per_s": gbps(nbytes, warm),
        "note": "one thread, in the driver before the workers start: the cost of first-touch page faults "
        "(pack and receive() write into freshly allocated buckets every sync)",
    }


# ---------------------------------------------------------------------------------- driver


def run_benchmark(args) -> dict:
    params = args.params or (10e6 if args.quick else 100e6)
    reps = args.reps or (2 if args.quick else 5)
    sweep_reps = args.sweep_reps or (1 if args.quick else 3)
    sweep_mib = [int(x) for x in args.sweep.split(",") if x]
    shapes, model = model_shapes(params)
    log(
        f"model: {model['params'] / 1e6:.1f}M params, {model['bytes'] / 1e6:.0f} MB, {model['layers']} layers; "
        f"reps {reps}, sweep {sweep_mib} MiB x {sweep_reps} reps"
    )
    host = copy_bandwidth(model["bytes"])
    log(f"memcpy: fresh dst {host['fresh_dst_gb_per_s']} GB/s, touched dst {host['touched_dst_gb_per_s']} GB/s")

    steps = make_plan(reps, sweep_reps, args.bucket_mib, sweep_mib)
    tmp = tempfile.mkdtemp(prefix="sluice-wsync-bench-")
    started = time.perf_counter()
    with LocalDCS(log_dir=tmp) as dcs:
        plan = {
            "dcs": dcs.url,
            "ctrl_port": free_port(),
            "timeout_s": args.timeout_s,
            "shapes": shapes,
            "model": model,
            "steps": steps,
        }
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        names = ["trainer"] + [f"receiver{i}" for i in range(RECEIVERS)]
        outs = {n: os.path.join(tmp, f"{n}.jsonl") for n in names}
        workers: dict[str, ChildProcess] = {}
        try:
            for n in names:
                role = "trainer" if n == "trainer" else "receiver"
                index = ["--index", n[len("receiver") :]] if role == "receiver" else []
                workers[n] = ChildProcess(
                    n,
                    [sys.executable, SELF, "--worker", role, *index, "--plan", plan_path, "--out", outs[n]],
                    os.path.join(tmp, f"{n}.log"),
                )
            wait_workers(workers, outs["trainer"], len(steps), args.deadline_s)
            with DCSClient(dcs.url) as c:
                raw_reports = c.sync_reports(RUN_ID, 1000)
        finally:
            for w in workers.values():
                w.stop()
    elapsed = time.perf_counter() - started

    trainer = read_events(outs["trainer"])
    receivers = [read_events(outs[f"receiver{i}"]) for i in range(RECEIVERS)]
    receiver_nodes = [next(e["node_id"] for e in evs if e["event"] == "ready") for evs in receivers]
    reports: dict = {}
    for r in raw_reports:  # a receiver reports receive() and loaded() separately: merge the phases
        if r.ok:
            reports.setdefault((r.version, r.node_id), {}).update(r.seconds)
    reports["_receivers"] = receiver_nodes
    failed_reports = [r.model_dump() for r in raw_reports if not r.ok]

    # verification: every sync, every receiver, version and digest equal to the trainer's
    published = {e["version"]: e for e in trainer if e["event"] == "sync"}
    checks, mismatches = 0, []
    for i, evs in enumerate(receivers):
        got = {e["expected_version"]: e for e in evs if e["event"] == "sync"}
        for v, e in published.items():
            r = got.get(v)
            checks += 1
            if r is None or r["version"] != v or r["digest"] != e["digest"] or r["bytes"] != e["bytes"]:
                mismatches.append(
                    {
                        "receiver": i,
                        "version": v,
                        "got": r and {k: r[k] for k in ("version", "digest")},
                        "want": e["digest"],
                    }
                )
    groups = sorted(
        {e["group"] for e in trainer if e["event"] == "sync"}
        | {e["group"] for evs in receivers for e in evs if e["event"] == "sync"}
    )

    raw = summarize_raw("raw", trainer, receivers)
    raw_fresh = summarize_raw("raw_fresh", trainer, receivers)
    headline = summarize_sync("headline", trainer, receivers, reports)
    sweep = {str(m): summarize_sync(f"sweep_{m}", trainer, receivers, reports) for m in sweep_mib}
    ratio = round(headline["gb_per_s"] / raw["gb_per_s"], 3)
    return {
        "benchmark": "weight_sync",
        "quick": bool(args.quick),
        "setup": {
            "processes": "1 trainer + 2 receivers (each its own process) + DCS + redis-server",
            "backend": "gloo",
            "transport": "TCP loopback",
            "cpus": os.cpu_count(),
            "threads_per_process": 1,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "GB": "1e9 bytes",
            "MiB": "2**20 bytes (bucket sizes)",
        },
        "model": {
            k: model[k] for k in ("params", "bytes", "dtype", "tensors", "layers", "hidden", "intermediate", "vocab")
        },
        "reps": {
            "headline": reps,
            "raw": reps,
            "sweep": sweep_reps,
            "warmups_dropped": 1,
            "note": f"headline/raw/raw_fresh: median of {reps} interleaved reps; sweep: median of "
            f"{sweep_reps} reps per bucket size (fewer, for runtime), each after its own warm-up",
        },
        "sluice": headline,
        "raw": raw,
        "raw_fresh": raw_fresh,
        "ratio": ratio,
        "ratio_end_to_end": round(headline["end_to_end_gb_per_s"] / raw["end_to_end_gb_per_s"], 3),
        "ratio_vs_raw_fresh": round(headline["gb_per_s"] / raw_fresh["gb_per_s"], 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "bucket_sweep": sweep,
        "verified": checks > 0 and not mismatches,
        "verification": {
            "checks": checks,
            "syncs": len(published),
            "receivers": RECEIVERS,
            "mismatches": mismatches[:5],
            "method": "sha256 of every received tensor vs. the trainer's, every sync incl. warm-ups",
        },
        "sync_groups": groups,
        "failed_sync_reports": failed_reports[:5],
        "host_memcpy": host,
        "runtime_s": round(time.perf_counter() - _T0, 1),
        "workers_runtime_s": round(elapsed, 1),
        "logs": tmp,
    }


def wait_workers(workers: dict[str, ChildProcess], trainer_out: str, n_steps: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    seen = 0
    while True:
        for name, w in workers.items():
            code = w.proc.poll()
            if code not in (None, 0):
                raise RuntimeError(f"{name} exited with {code}; log:\n{w.log_tail()}")
        events = read_events(trainer_out)
        for e in events[seen:]:
            if e["event"] == "raw":
                log(
                    f"step {e['step'] + 1}/{n_steps} {e['phase']}{'' if e['counted'] else ' (warm-up)'}: "
                    f"{e['seconds']:.3f} s, {e['bytes'] / e['seconds'] / 1e9:.3f} GB/s"
                )
            elif e["event"] == "sync":
                s = e["seconds"]
                log(
                    f"step {e['step'] + 1}/{n_steps} {e['phase']} v{e['version']} {e['bucket_mib']} MiB x"
                    f"{e['buckets']}{'' if e['counted'] else ' (warm-up)'}: total {s['total']:.3f} s "
                    f"(meta {s['metadata']:.3f}, pack {s['pack']:.3f}, bcast {s['broadcast']:.3f}), "
                    f"{e['bytes'] / s['total'] / 1e9:.3f} GB/s"
                )
            elif e["event"] == "ready":
                log("workers connected")
        seen = len(events)
        if all(w.proc.poll() == 0 for w in workers.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not done after {deadline_s}s; trainer log:\n{workers['trainer'].log_tail()}")
        time.sleep(0.2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~10M params, 2 reps, 1 sweep rep (smoke run)")
    p.add_argument("--params", type=float, default=None, help="model size in parameters (default 100e6; 10e6 quick)")
    p.add_argument("--reps", type=int, default=None, help="counted reps of headline/raw (default 5; 2 quick)")
    p.add_argument(
        "--sweep-reps", type=int, default=None, help="counted reps per sweep bucket size (default 3; 1 quick)"
    )
    p.add_argument("--sweep", default="16,64,256", help="bucket sizes in MiB for the sweep")
    p.add_argument("--bucket-mib", type=int, default=64, help="bucket size of the headline measurement")
    p.add_argument("--timeout-s", type=float, default=120.0, help="gloo/sync deadline per operation")
    p.add_argument("--deadline-s", type=float, default=900.0, help="give up on the workers after this long")
    p.add_argument("--worker", choices=["trainer", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    print(json.dumps(run_benchmark(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
