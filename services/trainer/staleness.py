"""How stale the trainer's samples were: versions between the weights a sample's generation began under and the
weights it is trained at (the rollout admits it only if that is at most max_staleness; the trainer checks)."""

from __future__ import annotations

import collections
import logging

from prometheus_client import Histogram

log = logging.getLogger(__name__)


def staleness_histogram() -> Histogram:
    return Histogram(
        "sluice_trainer_sample_staleness",
        "versions between a sample's generation and its training",
        buckets=(0, 1, 2, 3, 4, 8, 16),
    )


def staleness_metrics(step: int, staleness: collections.Counter, max_staleness: int) -> dict:
    """A step's staleness counts, its maximum and how many samples exceeded the bound (logged)."""
    violations = sum(n for s, n in staleness.items() if s > max_staleness)
    if violations:
        log.warning("samples exceeded max_staleness", extra={"step": step, "count": violations})
    return {
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "staleness_max": max(staleness),
        "staleness_violations": violations,
    }
