"""Packing a publish's buckets beside sending them: bucket k+1 is packed (and cast to the wire dtype) on a worker
thread while bucket k is sent, into two staging buffers reused from sync to sync (fresh memory each time costs a
page fault per page). The staging buffers live where the transfer reads them: host memory for gloo, the trainer's
GPU for nccl and CUDA IPC (so the cast and the copy stay on the GPU)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from services.dcs.sync.layout import WeightStream, pack


class BucketPacking:
    def __init__(self):
        self._packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-pack")
        self._staging: list[torch.Tensor] = []

    def close(self) -> None:
        self._packer.shutdown(wait=False)

    def _buffers(self, need: int, device: str) -> list[torch.Tensor]:
        if (
            len(self._staging) != 2
            or self._staging[0].numel() < need
            or self._staging[0].device != torch.device(device)
        ):
            self._staging = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(2)]
        return self._staging

    def send_all(
        self,
        entries,
        sizes: list[int],
        tensors: Callable[[int], dict],
        device: str,
        send: Callable[[int, list, torch.Tensor], None],
    ) -> dict[str, float]:
        """Pack every bucket (its tensors from `tensors(k)`) and `send(k, its entries, flat bucket)` it, packing
        the next while one is sent. Returns the seconds spent packing and sending."""
        staging = self._buffers(max(sizes), device)

        def timed_pack(k: int):
            start = time.perf_counter()
            flat = pack(k, entries, sizes[k], tensors(k), out=staging[k % 2][: sizes[k]])
            return flat, time.perf_counter() - start

        pack_s = send_s = 0.0
        pending = self._packer.submit(timed_pack, 0)
        try:
            for k in range(len(sizes)):
                flat, took = pending.result()
                pack_s += took
                if k + 1 < len(sizes):
                    pending = self._packer.submit(timed_pack, k + 1)  # overlaps the send below
                start = time.perf_counter()
                send(k, [e for e in entries if e.bucket == k], flat)
                send_s += time.perf_counter() - start
        except BaseException:
            # a stream is closed next (on this thread): its packing must have stopped taking from it
            pending.exception()
            raise
        return {"pack": pack_s, "broadcast": send_s}


def bucket_tensors(entries, buckets: int, named: list, stream: WeightStream | None):
    """bucket k -> its tensors by name: taken from the stream as the bucket is packed (so only about two
    buckets' worth exist at once), or looked up among all of `named`."""
    if stream is None:
        everything = dict(named)
        return lambda k: everything
    counts = [sum(e.bucket == k for e in entries) for k in range(buckets)]
    return lambda k: dict(stream.take(counts[k]))
