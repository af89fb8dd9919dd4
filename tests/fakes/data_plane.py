"""In-memory fakes of the seams roles are given (services/run_state/seams.py), for unit tests that run a
role in milliseconds. They keep the semantics a role relies on: a task claims only rows that have every
field it requires and it has not consumed, claims come in whole groups, a claim of a sealed partition the
task consumed entirely says `complete`, a field is written once per row."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import torch

from services.transferqueue.codec import Batch


@dataclass
class _Partition:
    group_size: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    sealed: bool = False
    consumed: dict[str, set[int]] = field(default_factory=dict)  # task -> rows acked


@dataclass
class PartitionInfo:
    name: str
    rows: int
    sealed: bool


@dataclass
class Ready:
    ready_rows: int
    partition_complete: bool


class InMemoryDataPlane:
    def __init__(self):
        self.partitions: dict[str, _Partition] = {}
        self.tasks: dict[str, list[str]] = {}
        self.leases: dict[str, tuple[str, str, list[int]]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ set-up, as the rollout would write

    def create_partition(self, name: str, group_size: int = 1) -> None:
        self.partitions[name] = _Partition(group_size)

    def seal_partition(self, name: str) -> None:
        self.partitions[name].sealed = True

    def column(self, partition: str, name: str) -> list:
        return [row.get(name) for row in self.partitions[partition].rows]

    # ------------------------------------------------------------ the DataPlane protocol

    def register_task(self, name: str, required_fields: Sequence[str], group_size: int = 1) -> None:
        self.tasks[name] = list(required_fields)

    def partition(self, name: str) -> PartitionInfo:
        p = self.partitions[name]
        return PartitionInfo(name, len(p.rows), p.sealed)

    def put(self, partition: str, columns: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[int]:
        p = self.partitions[partition]
        n = len(next(iter(columns.values())))
        with self._lock:
            if rows is None:
                rows = list(range(len(p.rows), len(p.rows) + n))
                p.rows.extend({} for _ in range(n))
            for name, values in columns.items():
                for row, value in zip(rows, values):
                    if name in p.rows[row]:
                        raise ValueError(f"row {row} already has {name}")
                    p.rows[row][name] = value
        return list(rows)

    def _ready_groups(self, partition: str, task: str) -> list[int]:
        """First rows of the groups `task` can claim: every field it needs, not consumed, not leased."""
        p, required = self.partitions[partition], self.tasks[task]
        taken = {r for _, t, rows in self.leases.values() if t == task for r in rows}
        done = p.consumed.setdefault(task, set())
        return [r for r in range(0, len(p.rows) - len(p.rows) % p.group_size, p.group_size)
                if all(all(f in p.rows[r + k] for f in required) for k in range(p.group_size))
                and r not in done and r not in taken]

    def _complete(self, partition: str, task: str) -> bool:
        p = self.partitions[partition]
        return p.sealed and len(p.consumed.setdefault(task, set())) == len(p.rows)

    def claim_rows(self, partition: str, task: str, batch_size: int, wait_s: float = 0.0, lease_s: float = 0.0,
                   min_rows: int = 0, claim_key: str = "") -> SimpleNamespace:
        p = self.partitions[partition]
        if min_rows and self.wait_ready(partition, task, min_rows, wait_s).ready_rows < min_rows:
            return SimpleNamespace(partition=partition, task=task, lease_id="", rows=[],
                                   complete=self._complete(partition, task), group_size=p.group_size)
        with self._lock:
            ready = self._ready_groups(partition, task)
            rows = [r + k for r in ready[:max(1, batch_size // p.group_size)] for k in range(p.group_size)]
            lease = f"lease-{next(self._ids)}" if rows else ""
            if rows:
                self.leases[lease] = (partition, task, rows)
        return SimpleNamespace(partition=partition, task=task, lease_id=lease, rows=rows,
                               complete=not rows and self._complete(partition, task), group_size=p.group_size)

    def claim(self, partition: str, task: str, batch_size: int, fields: Sequence[str] | None = None,
              wait_s: float = 0.0, lease_s: float = 0.0, min_rows: int = 0, padded: bool = False,
              pad_value: int = 0) -> Batch:
        claimed = self.claim_rows(partition, task, batch_size)
        if not claimed.rows:
            return Batch(partition, [], {}, complete=claimed.complete)
        return self._batch(partition, claimed.rows, list(fields or self.tasks[task]), claimed.lease_id)

    def wait_ready(self, partition: str, task: str, min_rows: int, wait_s: float) -> Ready:
        with self._lock:
            ready = len(self._ready_groups(partition, task)) * self.partitions[partition].group_size
            complete = ready == 0 and self._complete(partition, task)
        if ready < min_rows and not complete:
            time.sleep(min(wait_s, 0.01))  # a long poll, briefly: the caller loops
        return Ready(ready, complete)

    def release(self, lease: str | Batch) -> int:
        lease_id = lease.lease_id if isinstance(lease, Batch) else lease
        return len(self.leases.pop(lease_id)[2])

    def read_claimed(self, claimed, fields: Sequence[str], padded: bool = False, pad_value: int = 0) -> Batch:
        return self._batch(claimed.partition, list(claimed.rows), list(fields), claimed.lease_id)

    def get(self, partition: str, rows: Sequence[int], fields: Sequence[str], padded: bool = False,
            pad_value: int = 0) -> Batch:
        return self._batch(partition, list(rows), list(fields), "")

    def ack(self, lease: str | Batch, rows: Sequence[int] = ()) -> int:
        lease_id = lease.lease_id if isinstance(lease, Batch) else lease
        partition, task, leased = self.leases.pop(lease_id)
        self.partitions[partition].consumed.setdefault(task, set()).update(leased)
        return len(leased)

    def close(self) -> None:
        pass

    def _batch(self, partition: str, rows: list[int], fields: list[str], lease: str) -> Batch:
        """Columns as the real decoder gives them: a tensor for scalars, a list of tensors for ragged fields."""
        p = self.partitions[partition]
        columns = {}
        for name in fields:
            values = [p.rows[r][name] for r in rows]
            scalar = all(torch.as_tensor(v).dim() == 0 for v in values)
            columns[name] = torch.stack([torch.as_tensor(v) for v in values]) if scalar else \
                [torch.as_tensor(v) for v in values]
        return Batch(partition=partition, rows=rows, columns=columns, lease_id=lease)


class FakeMembership:
    """Always running; records the progress reported."""

    node_id = "fake-node"

    def __init__(self, *args, **kwargs):
        self.steps: list[int] = []
        self.versions: list[int] = []
        self.closed = False

    def safe_point(self, stop=None, while_paused=None) -> None:
        pass

    def progress(self, step: int | None = None, weight_version: int | None = None) -> None:
        if step is not None:
            self.steps.append(step)
        if weight_version is not None:
            self.versions.append(weight_version)

    def close(self) -> None:
        self.closed = True
