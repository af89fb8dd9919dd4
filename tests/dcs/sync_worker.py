"""A trainer or a receiver of weight syncs, as its own process, for the sync tests.

    python -m tests.dcs.sync_worker trainer --dcs URL --run-id R --versions 3 --receivers 2 --out F
    python -m tests.dcs.sync_worker receiver --dcs URL --run-id R --until 3 --out F [--die-at V:K] [--stop-at V:K]

Each writes JSON lines to --out: what it published or received, with a SHA-256 of every tensor's
bytes (bit-identity is checked by comparing digests)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time

import torch

from services.dcs.client import DCSClient
from services.dcs.models import Heartbeat, NodeRegistration
from services.dcs.sync.publisher import SyncFailed, WeightPublisher
from services.dcs.sync.receiver import NotInGroup, WeightReceiver

torch.set_num_threads(1)
SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "lm_head.weight": (256, 64),
}


def weights(version: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in SHAPES.items()}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


HEARTBEAT = threading.Lock()  # a beat reads the version and lands before the next one reads it: never one stale last


def heartbeats(dcs_url: str, node_id: str, state: dict) -> None:
    with DCSClient(dcs_url) as dcs:
        while True:
            try:
                with HEARTBEAT:
                    dcs.heartbeat(node_id, Heartbeat(weight_version=state.get("version", 0)))
            except Exception:
                pass
            time.sleep(0.2)


def wait_for_receivers(dcs: DCSClient, run_id: str, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(n.alive for n in dcs.topology().roles.get("actor_fwd", []) if n.run_id == run_id) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} receivers alive after {timeout_s} s")
        time.sleep(0.05)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["trainer", "receiver"])
    p.add_argument("--dcs", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--versions", type=int, default=2)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--until", type=int, default=2)
    p.add_argument("--die-at", default="", help="V:K -> SIGKILL itself after bucket K of version V")
    p.add_argument("--stop-at", default="", help="V:K -> SIGSTOP itself after bucket K of version V")
    p.add_argument(
        "--rejoin-version",
        type=int,
        default=0,
        help="trainer: before publishing this version, wait for --receivers live receivers again",
    )
    p.add_argument("--timeout-s", type=float, default=3.0)
    p.add_argument("--bucket-bytes", type=int, default=40_000)
    p.add_argument("--retry-after-s", type=float, default=2.0)
    p.add_argument("--streamed", action="store_true", help="trainer: publish from a WeightStream")
    return p.parse_args()


class RecordingStream:
    """A WeightStream over `tensors` that records how it was taken (each take's count, whether it was closed)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.named, self.next, self.takes, self.closed = list(tensors.items()), 0, [], False

    def specs(self):
        return [(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in self.named]

    def take(self, count: int):
        assert not self.closed, "taken after close"
        out = [(n, t.clone()) for n, t in self.named[self.next : self.next + count]]
        self.next += len(out)
        self.takes.append(count)
        return out

    def close(self) -> None:
        self.closed = True


def publish_versions(args, dcs: DCSClient, node_id: str, out) -> None:
    dtype = getattr(torch, args.dtype)
    wait_for_receivers(dcs, args.run_id, args.receivers)
    publisher = WeightPublisher(
        dcs,
        node_id,
        "127.0.0.1",
        bucket_bytes=args.bucket_bytes,
        timeout_s=args.timeout_s,
        receiver_roles=["actor_fwd"],
        run_id=args.run_id,
    )
    for version in range(1, args.versions + 1):
        if version == args.rejoin_version:
            wait_for_receivers(dcs, args.run_id, args.receivers)
        tensors = weights(version, dtype)
        stream = RecordingStream(tensors) if args.streamed else None
        taken = (lambda: {"takes": stream.takes, "closed": stream.closed}) if stream else dict
        try:
            res = publisher.publish(stream or tensors.items(), version)
            out.write(
                json.dumps(
                    {
                        "event": "published",
                        "version": version,
                        "digest": digest(tensors),
                        "world_size": res.world_size,
                        "seconds": res.seconds,
                        **taken(),
                    }
                )
                + "\n"
            )
        except SyncFailed as exc:
            out.write(
                json.dumps(
                    {
                        "event": "failed",
                        "version": version,
                        "error": exc.result.error,
                        "seconds": exc.result.seconds,
                        **taken(),
                    }
                )
                + "\n"
            )
            time.sleep(args.retry_after_s)  # let the dead member's lease lapse
        time.sleep(0.3)  # receivers see each version
    publisher.close()


def _at(spec: str) -> tuple[int, int]:
    return tuple(int(x) for x in spec.split(":")) if spec else (-1, -1)


def receive_versions(args, dcs: DCSClient, node_id: str, out, state: dict) -> None:
    die_at, stop_at = _at(args.die_at), _at(args.stop_at)
    receiver = WeightReceiver(dcs, node_id, "actor_fwd", timeout_s=args.timeout_s, run_id=args.run_id)
    receiver.declare()
    current = weights(0, getattr(torch, args.dtype))  # the weights "serving" before any sync
    out.write(json.dumps({"event": "ready", "digest": digest(current)}) + "\n")
    while receiver.version < args.until:
        published = receiver.next(wait_s=5)
        if published is None:
            continue

        def on_bucket(k: int, version=published.version):
            if (version, k) == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if (version, k) == stop_at:
                out.write(json.dumps({"event": "stopping", "version": version}) + "\n")
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen, heartbeats too, until the test sends SIGCONT

        try:
            tensors = receiver.receive(published, on_bucket=on_bucket)
        except NotInGroup:
            receiver.version = published.version
            continue
        except Exception as exc:
            out.write(
                json.dumps(
                    {"event": "failed", "version": published.version, "error": str(exc), "serving": digest(current)}
                )
                + "\n"
            )
            receiver.version = published.version  # that version is gone; wait for the next
            continue
        start = time.perf_counter()
        current = {k: v.clone() for k, v in tensors.items()}  # the swap: only after every bucket arrived
        receiver.loaded(published, time.perf_counter() - start)
        with HEARTBEAT:
            state["version"] = published.version
            dcs.heartbeat(node_id, Heartbeat(weight_version=published.version))  # report it at once
        out.write(json.dumps({"event": "received", "version": published.version, "digest": digest(current)}) + "\n")
    receiver.close()


def main() -> None:
    args = parse_args()
    out = open(args.out, "a", buffering=1)
    dcs = DCSClient(args.dcs)
    role = "trainer" if args.role == "trainer" else "actor_fwd"
    node = dcs.register(NodeRegistration(role=role, host="127.0.0.1", run_id=args.run_id))
    state = {"version": 0}
    threading.Thread(target=heartbeats, args=(args.dcs, node.node_id, state), daemon=True).start()
    if args.role == "trainer":
        publish_versions(args, dcs, node.node_id, out)
    else:
        receive_versions(args, dcs, node.node_id, out, state)


if __name__ == "__main__":
    main()
