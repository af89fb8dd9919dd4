"""What the actor trainer tallies over one step's global batches, and the step's metrics made from it: the time
it waited for rows and computed (every rank), and on the leader each batch's sample ids (the step's audit
record), staleness, rewards, response lengths and loss metrics."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import Histogram

from services.run_contract.partitions import sample_id
from services.trainer.actor_update import StepMetrics
from services.trainer.staleness import staleness_metrics
from services.trainer.tracking_hook import sample_stats
from services.transferqueue.codec import Batch


@dataclass
class StepTally:
    histogram: Histogram  # the process's staleness histogram (staleness.py), observed per sample
    wait_s: float = 0.0
    compute_s: float = 0.0  # waits for the GPU's kernels (DeviceClock)
    tokens: float = 0.0
    ids: list[str] = field(default_factory=list)
    staleness: collections.Counter[int] = field(default_factory=collections.Counter)
    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    iterations: list[StepMetrics] = field(default_factory=list)

    def add(
        self, info: Batch, metrics: StepMetrics, tokens: float, version: int, lag: Callable[[int, int], int]
    ) -> None:
        """A trained global batch (the leader's): `info` its record fields, trained at `version`; `lag` counts
        the versions between a sample's generation and its training (WeightVersions.lag)."""
        for s in (lag(version, int(g)) for g in info["weight_version"].tolist()):
            self.staleness[int(s)] += 1
            self.histogram.observe(s)
        self.rewards.extend(info["reward"].tolist())
        self.lengths.extend(info["response_length"].tolist())
        self.iterations.append(metrics)
        self.tokens += tokens
        self.ids.extend(sample_id(int(p), int(k)) for p, k in zip(info["prompt_position"], info["sample_index"]))

    def metrics(self, step: int, max_staleness: int, **trained) -> dict:
        """The step's metrics: the loss metrics' means over its iterations, its samples' stats, tokens and times,
        what the caller passes in `trained` (the version trained, the ranks, the learning rate, the memory) and
        its staleness (staleness_metrics: the samples over max_staleness are logged)."""
        means = [m.means() for m in self.iterations]
        metrics = {k: sum(x[k] for x in means if k in x) / len(means) for k in means[0] if k not in ("tokens",)}
        metrics.update(
            **sample_stats(self.rewards, self.lengths),
            tokens=self.tokens,
            wait_s=self.wait_s,
            compute_s=self.compute_s,
            tokens_per_s=self.tokens / max(self.compute_s, 1e-9),
            **trained,
            **staleness_metrics(step, self.staleness, max_staleness),
        )
        return metrics
