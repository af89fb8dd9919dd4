"""The broadcast path of a weight publish (a part of WeightPublisher, in its own module): the weights to every
receiver of the sync group, bucket by bucket, the engines paused as their mode says.

    plan      : the wire dtype the receivers serve (precision.py), the widest transfer every engine takes
                (engine_calls.py), the buckets laid out as that transfer sends them (layout.py)
    announce  : the engines paused first, then the version's metadata published to the coordinator
    open      : the broadcast group (none for CUDA IPC), joined by the engines over HTTP while this process
                joins as rank 0
    transfer  : bucket k+1 packed while bucket k is broadcast (bucket_packing.py), bracketed by
                /begin ... /end_weight_update for the engines that need it; the engines resumed in a finally"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from services.dcs.sync.bucket_packing import BucketPacking, bucket_tensors
from services.dcs.sync.coordinator import PublishingCoordinator
from services.dcs.sync.engine_calls import PUBLISHED_TRANSFER, SyncEngines, Transfer
from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.layout import WeightStream, plan_buckets
from services.dcs.sync.messages import WeightMetadata
from services.dcs.sync.precision import FLOATING, wire_dtype
from services.sglang_protocol.client import SGLangClient

if TYPE_CHECKING:
    from services.dcs.sync.publisher import SyncResult


class WeightBroadcast:
    """WeightPublisher's broadcast of a version (module docstring)."""

    # WeightPublisher's, set in its __init__
    dcs: PublishingCoordinator
    run_id: str
    node_id: str
    engine_role: str
    bucket_bytes: int
    timeout_s: float
    device: str
    engines: SyncEngines
    _group: BroadcastGroup | None  # the open broadcast group, reused while the group stays the same
    _packing: BucketPacking
    _failed: bool  # the last sync failed: the next asks the coordinator for a new group

    def _broadcast(
        self,
        group_spec,
        named: list,
        stream: WeightStream | None,
        version: int,
        announce: bool,
        result: SyncResult,
        t0: float,
    ) -> None:
        """The weights to every receiver of the group by broadcast, the engines paused as their mode says."""
        entries, sizes, transfer = self._plan(group_spec, named, result)
        paused: list[SGLangClient] = []
        try:
            # engines first: one that cannot be paused fails the sync before the version is
            # announced, so no receiver starts waiting on a broadcast that will not come
            self.engines.pause(paused)
            if announce:
                self.dcs.publish_weights(
                    self.run_id,
                    WeightMetadata(
                        version=version,
                        tensors=entries,
                        bucket_bytes=sizes,
                        publisher=self.node_id,
                        sync_group=group_spec,
                        transfer=PUBLISHED_TRANSFER[transfer],
                    ),
                )
                result.announced = True
            result.seconds["metadata"] = time.perf_counter() - t0
            if transfer != "cuda_ipc" and (self._group is None or self._group.name != group_spec.name):
                self._open_group(group_spec)
                result.seconds["open_group"] = time.perf_counter() - t0 - result.seconds["metadata"]
            self._failed = False
            self._transfer(
                entries, sizes, bucket_tensors(entries, len(sizes), named, stream), result, transfer, str(version)
            )
        finally:
            self.engines.resume(paused)

    def _plan(self, spec, named: list, result: SyncResult) -> tuple[list, list, Transfer]:
        """The wire dtype, the group's transfer and the buckets, laid out as that transfer sends them: the
        entries and bucket sizes."""
        wire = self._wire_dtype(spec, named)
        result.wire_dtype = str(wire).removeprefix("torch.")
        transfer: Transfer = self.engines.transfer(spec.backend)
        result.transfer = transfer
        entries, sizes = plan_buckets(named, self.bucket_bytes, wire, packed=transfer == "flattened_bucket")
        result.bytes = sum(sizes)
        return entries, sizes, transfer

    def _wire_dtype(self, spec, named: list) -> torch.dtype:
        """What floating tensors travel in: the dtype every receiver serves, when they agree (precision.py);
        engines say theirs over HTTP (asked once per connection), the other receivers in their registration."""
        declared = [
            self.engines.clients[m.node_id].served_dtype() if m.role == self.engine_role else m.weights_dtype
            for m in spec.members
            if m.node_id != self.node_id
        ]
        source = next((t.dtype for _, t in named if t.dtype in FLOATING), torch.float32)
        return wire_dtype(declared, source)

    def _transfer(self, entries, sizes, tensors, result: SyncResult, transfer: Transfer, version: str) -> None:
        """The buckets to every receiver, bracketed by /begin ... /end_weight_update for engines that need it:
        a live-update engine loads a single bucket when its call ends (two HTTP round trips fewer); SGLang
        0.5.23, and any engine receiving several buckets, get the bracket, and every begin gets its end, also
        when the transfer fails (0.5.23 refuses a second begin). An engine that says another version than the
        one it loaded (SGLang 0.5.6 records none for an update made while paused) is told the version."""
        began = time.perf_counter()
        bracket = len(sizes) > 1
        engines = self.engines

        def brackets(e: SGLangClient) -> bool:
            return bracket or not e.live_weight_update()

        def begin(_: object, e: SGLangClient) -> None:
            if brackets(e):
                e.begin_weight_update()

        def end(e: SGLangClient) -> None:
            if brackets(e):
                e.end_weight_update()

        def tell_version(_: object, e: SGLangClient) -> None:
            if engines.mode(e) != "none":
                e.ensure_weight_version(version)

        try:
            engines.each(begin)
            # measured, not derived: packing overlaps the broadcast, so wall - pack - broadcast can be negative
            result.seconds["engines"] = time.perf_counter() - began
            device = self.device if result.backend in ("nccl", "ipc") else "cpu"  # gloo reads host memory
            result.seconds.update(
                self._packing.send_all(
                    entries,
                    sizes,
                    tensors,
                    device,
                    lambda k, bucket, flat: engines.send_bucket(self._group, bucket, flat, sizes[k], transfer, version),
                )
            )
        except BaseException:
            engines.each_quietly(end)
            raise
        loading = time.perf_counter()
        engines.each(lambda _, e: end(e))
        engines.each(tell_version)
        result.seconds["engine_load"] = time.perf_counter() - loading

    def _open_group(self, spec) -> None:
        """Engines join through /init_weights_update_group, which blocks until everyone joined, so
        their calls run while this process joins as rank 0."""
        if self._group is not None:
            self._group.close()
        joins = self.engines.join(spec)
        self._group = BroadcastGroup.open(
            spec.name, spec.backend, spec.master_address, spec.master_port, 0, spec.world_size, self.timeout_s
        )
        for join in joins:
            join.result(timeout=self.timeout_s)
