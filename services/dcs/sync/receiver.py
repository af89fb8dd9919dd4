"""A receiver's side of a weight sync (actor_fwd, reference, the built-in engine's loader).

Receive version V into fresh buffers and hand back the complete set of tensors only when every
bucket arrived: the caller swaps them into its model afterwards, so a failed sync leaves the old
weights serving. Groups are reused while DCS keeps the same group; a failure drops the group."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from services.dcs.sync.coordinator import ReceivingCoordinator
from services.dcs.sync.messages import PublishedWeights, SyncReport
from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.layout import TORCH_DTYPES, unpack
from services.dcs.sync.precision import load_into
from services.runtime.spans import RECORDER

log = logging.getLogger(__name__)


class NotInGroup(RuntimeError):
    """This node is not a member of the version's sync group (it joined later): wait for the next."""


class WeightReceiver:
    """Receives into its own bucket buffers, reused from sync to sync (fresh memory each time costs a
    page fault per page): the tensors `receive` returns are views that stay valid until the next
    `receive`; load them into the model (load_into) or copy them before that."""

    def __init__(
        self,
        dcs: ReceivingCoordinator,
        node_id: str,
        role: str,
        timeout_s: float = 60.0,
        device: str = "cpu",
        *,
        run_id: str,
    ):
        self.dcs = dcs
        self.run_id = run_id  # versions, cursors and sync reports are the run's own
        self._buffers: list[torch.Tensor] = []
        self.node_id = node_id
        self.role = role
        self.timeout_s = timeout_s
        self.device = device
        self._group: BroadcastGroup | None = None
        self.version = 0

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def declare(self) -> None:
        """Tell DCS this role consumes weights (its cursor holds metadata until it has read it)."""
        self.dcs.set_cursor(self.run_id, self.role, self.dcs.cursors_of(self.run_id, self.role))

    def next(self, wait_s: float) -> PublishedWeights | None:
        return self.dcs.next_weights(self.run_id, self.version, wait_s)

    def receive(
        self, published: PublishedWeights, on_bucket: Callable[[int], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """All tensors of `published`, or an exception (and nothing changed)."""
        spec = published.sync_group
        me = next((m for m in (spec.members if spec else []) if m.node_id == self.node_id), None)
        if me is None:
            raise NotInGroup(f"node {self.node_id} is not in the sync group of version {published.version}")
        assert spec is not None  # `me` is one of its members
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}
        try:
            if self._group is None or self._group.name != spec.name:
                self.close()
                # a group forms only while its publisher waits (its deadline runs from the announcement): one
                # whose window has passed is not joined, so a receiver that fell behind catches the next sync
                # instead of waiting out each stale one in turn (seen in the chaos test after a trainer restart)
                window = published.published_at + self.timeout_s - time.time()
                if window <= 0:
                    raise TimeoutError(
                        f"the sync of version {published.version} was announced {-window:.1f}s "
                        f"past its {self.timeout_s:g}s deadline; waiting for the next"
                    )
                self._group = BroadcastGroup.open(
                    spec.name,
                    spec.backend,
                    spec.master_address,
                    spec.master_port,
                    me.rank,
                    spec.world_size,
                    self.timeout_s,
                    form_within_s=window,
                )
            seconds["metadata"] = time.perf_counter() - t0
            tensors: dict[str, torch.Tensor] = {}
            start = time.perf_counter()
            self._ensure_buffers(published.bucket_bytes)
            for k, size in enumerate(published.bucket_bytes):
                flat = self._buffers[k][:size]
                if published.transfer == "flat_buckets":
                    self._group.broadcast(flat, 0)
                else:  # one broadcast per tensor, in list order, straight into its place in the bucket
                    for e in published.tensors:
                        if e.bucket == k:
                            self._group.broadcast(flat[e.offset : e.offset + e.nbytes].view(TORCH_DTYPES[e.dtype]), 0)
                tensors.update(unpack(k, published.tensors, flat))
                if on_bucket:
                    on_bucket(k)
            seconds["broadcast"] = time.perf_counter() - start
        except Exception as exc:
            self.close()
            seconds["total"] = time.perf_counter() - t0
            self._report(published, False, f"{type(exc).__name__}: {exc}", seconds)
            raise
        self.version = published.version
        seconds["total"] = time.perf_counter() - t0
        self._report(published, True, None, seconds)
        return tensors

    def _ensure_buffers(self, sizes) -> None:
        if len(self._buffers) != len(sizes) or any(b.numel() < n for b, n in zip(self._buffers, sizes)):
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]

    def loaded(self, published: PublishedWeights, load_seconds: float) -> None:
        """After the caller swapped the tensors in (taking load_seconds): advance this role's cursor
        and report the load phase."""
        self.dcs.set_cursor(self.run_id, self.role, published.version)
        self._report(published, True, None, {"load": load_seconds}, nbytes=0)  # the bytes were counted

    def _report(
        self, published: PublishedWeights, ok: bool, error: str | None, seconds: dict, nbytes: int | None = None
    ) -> None:
        try:
            assert published.sync_group is not None  # received through it; else logged below as unreported
            self.dcs.report_sync(
                self.run_id,
                SyncReport(
                    version=published.version,
                    group=published.sync_group.name,
                    node_id=self.node_id,
                    ok=ok,
                    error=error,
                    seconds=seconds,
                    bytes=sum(published.bucket_bytes) if nbytes is None else nbytes,
                ),
            )
        except Exception as exc:
            log.warning("could not report sync", extra={"error": str(exc)})


def follow_weights(receiver: WeightReceiver, model: torch.nn.Module, wait_s: float) -> int | None:
    """Receive the next published version (waiting up to wait_s) into `model`: the version loaded,
    or None. A version whose group does not include this node is skipped; a failed sync keeps the
    old weights (logged) and moves on, since that version's broadcast is over."""
    published = receiver.next(wait_s)
    if published is None:
        return None
    began = time.time()
    try:
        tensors = receiver.receive(published)
    except NotInGroup:
        receiver.version = published.version
        return None
    except Exception as exc:
        receiver.version = published.version
        log.error("weight sync failed; the old weights stay", extra={"version": published.version, "error": str(exc)})
        return None
    start = time.perf_counter()
    load_into(model, tensors)
    receiver.loaded(published, time.perf_counter() - start)
    RECORDER.record("weight_load", began, time.time(), version=published.version)
    return published.version
