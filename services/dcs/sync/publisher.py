"""The trainer's side of a weight sync: publish version V and broadcast it bucket by bucket.

    metadata : lay tensors out in buckets, get the sync group for the live receivers from DCS,
               publish the metadata (with the group) so receivers start joining
    pack     : copy tensors into flat bucket k+1 on a worker thread ...
    broadcast: ... while bucket k is broadcast (rank 0 is the only source)
Every phase has a deadline; a failure closes the group (the next sync asks for a new one, without
members that died) and is reported to DCS. The result carries per-phase seconds and bytes."""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import torch

from services.dcs.client import DCSClient
from services.dcs.models import SyncGroupRequest, SyncReport, WeightMetadata
from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.layout import pack, plan_buckets

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    version: int
    ok: bool
    group: str = ""
    world_size: int = 0
    bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class SyncFailed(RuntimeError):
    def __init__(self, result: SyncResult):
        super().__init__(f"weight sync of version {result.version} failed: {result.error}")
        self.result = result


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightPublisher:
    def __init__(self, dcs: DCSClient, node_id: str, master_address: str, bucket_bytes: int = 64 << 20,
                 timeout_s: float = 60.0, receiver_roles: Iterable[str] = ("engine", "actor_fwd", "reference"),
                 backend: str = "gloo"):
        self.dcs = dcs
        self.node_id = node_id
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.receiver_roles = list(receiver_roles)
        self.backend = backend
        self._group: BroadcastGroup | None = None
        self._failed = False
        self._packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-pack")

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        self._packer.shutdown(wait=False)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncResult:
        named = list(named)
        result = SyncResult(version=version, ok=False)
        t0 = time.perf_counter()
        try:
            entries, sizes = plan_buckets(named, self.bucket_bytes)
            result.bytes = sum(sizes)
            group_spec = self.dcs.sync_group(SyncGroupRequest(
                source_node=self.node_id, master_address=self.master_address,
                master_port=_free_port(self.master_address),  # used only if DCS makes a new group
                receiver_roles=self.receiver_roles, backend=self.backend, new_group=self._failed))
            result.group, result.world_size = group_spec.name, group_spec.world_size
            self.dcs.publish_weights(WeightMetadata(version=version, tensors=entries, bucket_bytes=sizes,
                                                    publisher=self.node_id, sync_group=group_spec))
            result.seconds["metadata"] = time.perf_counter() - t0
            if self._group is None or self._group.name != group_spec.name:
                if self._group is not None:
                    self._group.close()
                self._group = BroadcastGroup.open(group_spec.name, self.backend, group_spec.master_address,
                                                  group_spec.master_port, 0, group_spec.world_size, self.timeout_s)
            self._failed = False
            self._broadcast(entries, sizes, dict(named), result)
            result.ok = True
        except Exception as exc:
            self._failed = True
            if self._group is not None:
                self._group.close()  # a group that saw a failure is not reused
                self._group = None
            result.error = f"{type(exc).__name__}: {exc}"
        result.seconds["total"] = time.perf_counter() - t0
        self._report(result)
        if not result.ok:
            raise SyncFailed(result)
        return result

    def _broadcast(self, entries, sizes, tensors, result: SyncResult) -> None:
        pack_s = 0.0

        def timed_pack(k: int):
            start = time.perf_counter()
            flat = pack(k, entries, sizes[k], tensors)
            return flat, time.perf_counter() - start

        broadcast_s = 0.0
        pending = self._packer.submit(timed_pack, 0)
        for k in range(len(sizes)):
            flat, took = pending.result()
            pack_s += took
            if k + 1 < len(sizes):
                pending = self._packer.submit(timed_pack, k + 1)  # overlaps the broadcast below
            start = time.perf_counter()
            self._group.broadcast(flat, 0)
            broadcast_s += time.perf_counter() - start
        result.seconds["pack"] = pack_s
        result.seconds["broadcast"] = broadcast_s

    def _report(self, result: SyncResult) -> None:
        try:
            self.dcs.report_sync(SyncReport(version=result.version, group=result.group or "none",
                                            node_id=self.node_id, ok=result.ok, error=result.error,
                                            seconds=result.seconds, bytes=result.bytes))
        except Exception as exc:  # reporting must not turn a good sync into a failure
            log.warning("could not report sync", extra={"error": str(exc)})
