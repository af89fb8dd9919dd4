"""Token-balanced split of a batch across data-parallel ranks."""

from __future__ import annotations

import heapq
from typing import Sequence


def balanced_split(weights: Sequence[float], parts: int) -> list[list[int]]:
    """Split item indices into `parts` lists whose weight sums are as even as greedy LPT makes them
    (largest item first onto the lightest part; ties broken by index, so every rank computes the
    same split). Items keep ascending index order inside a part."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    heap = [(0.0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + weights[i], p))
    return [sorted(x) for x in out]
