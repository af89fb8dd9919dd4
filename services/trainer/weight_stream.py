"""A sharded trainer's weights as a WeightStream (services/dcs/sync/layout.py): full tensors made one at a time
by a collective every rank joins in the same order, so the publisher on the leader takes a bucket's worth,
broadcasts it and drops it, and no rank ever holds the whole model. The other ranks make the same stream
and `close` it at once: they take part in every gather and keep nothing."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class GatheredParameters:
    """(name, parameter) pairs whose full tensor `full(parameter)` gathers from every rank (FSDP2's
    DTensor.full_tensor)."""

    def __init__(
        self, named: Sequence[tuple[str, torch.Tensor]], full: Callable[[torch.Tensor], torch.Tensor], keep: bool
    ):
        self._named, self._full, self._keep = list(named), full, keep
        self._next = 0

    def specs(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, torch.empty(p.shape, dtype=p.dtype, device="meta")) for name, p in self._named]

    def take(self, count: int) -> list[tuple[str, torch.Tensor]]:
        out = []
        with torch.no_grad():
            for name, p in self._named[self._next : self._next + count]:
                full = self._full(p)  # every rank, in the same order
                if self._keep:
                    out.append((name, full.to("cpu")))
        self._next = min(self._next + count, len(self._named))
        return out

    def close(self) -> None:
        self.take(len(self._named) - self._next)
