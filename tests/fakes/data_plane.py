"""In-memory fakes of the data plane (services/run_state/seams.py: DataPlane, and the rollout's AsyncDataPlane).
They keep the semantics a role relies on: a task claims only rows that have every field it requires and it has
not consumed, claims come in whole groups, a claim of a sealed partition the task consumed entirely says
`complete`, a field is written once per row, a partition that does not exist (or was cleared) is NOT_FOUND.
Every ack and clear is logged, so a test can check each row was consumed exactly once."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import grpc
import torch

from services.transferqueue.codec import Batch
from services.transferqueue.errors import TQError


@dataclass
class _Partition:
    group_size: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    sealed: bool = False
    consumed: dict[str, set[int]] = field(default_factory=dict)  # task -> rows acked (or lost before)
    lost: dict[str, set[int]] = field(default_factory=dict)  # task -> rows lost before it consumed them
    lost_rows: int = 0


@dataclass
class PartitionInfo:
    name: str
    rows: int
    sealed: bool
    allocated_rows: int = 0
    tasks: list = field(default_factory=list)  # per task: .task, .consumed (rows acked)
    lost_rows: int = 0


@dataclass
class Ready:
    ready_rows: int
    partition_complete: bool


class InMemoryDataPlane:
    def __init__(self):
        self.partitions: dict[str, _Partition] = {}
        self.tasks: dict[str, list[str]] = {}
        self.leases: dict[str, tuple[str, str, list[int]]] = {}
        self.lost_under: dict[str, set[int]] = {}  # lease -> its rows lost while it held them
        self.acks: list[tuple[str, str, list[int]]] = []  # (partition, task, rows) of every ack, in order
        self.cleared: list[str] = []
        self._ids = itertools.count()
        self._lock = threading.RLock()

    # ------------------------------------------------------------ set-up, as the rollout would write

    def create_partition(self, name: str, group_size: int = 1, exist_ok: bool = False) -> None:
        if name in self.partitions:
            if not exist_ok:
                raise TQError(grpc.StatusCode.ALREADY_EXISTS, f"partition {name} exists")
            return
        self.partitions[name] = _Partition(group_size)

    def seal_partition(self, name: str) -> None:
        self._get(name).sealed = True

    def column(self, partition: str, name: str) -> list:
        return [row.get(name) for row in self.partitions[partition].rows]

    def acked_rows(self, partition: str, task: str) -> list[int]:
        """Every row `task` acked in `partition`, once per ack (a row acked twice is listed twice)."""
        return sorted(r for p, t, rows in self.acks if (p, t) == (partition, task) for r in rows)

    def lose(self, partition: str, rows: Sequence[int]) -> None:
        """As the controller when a shard comes back without `rows`: their groups are lost. For every task
        that had not consumed one: a group a lease of the task holds stays in it, lost under it (an ack
        consumes it, a release loses it then); any other counts as consumed and is listed as lost before
        that task consumed it, and the partition is unsealed."""
        with self._lock:
            p = self._get(partition)
            gs = p.group_size
            lost = sorted({g * gs + k for r in rows for g in [r // gs] for k in range(gs)})
            p.lost_rows += len(lost)
            for task in self.tasks:
                fresh = {r for r in lost if r not in p.consumed.setdefault(task, set())}
                for lease, (part, t, held) in self.leases.items():
                    if (part, t) == (partition, task) and fresh & set(held):
                        self.lost_under.setdefault(lease, set()).update(fresh & set(held))
                        fresh -= set(held)
                self._lose(p, task, fresh)

    def _lose(self, p: _Partition, task: str, rows) -> None:
        p.consumed.setdefault(task, set()).update(rows)
        p.lost.setdefault(task, set()).update(rows)
        p.sealed = p.sealed and not rows

    def _get(self, name: str) -> _Partition:
        p = self.partitions.get(name)
        if p is None:
            raise TQError(grpc.StatusCode.NOT_FOUND, f"partition {name} not found")
        return p

    # ------------------------------------------------------------ the DataPlane protocol

    def register_task(self, name: str, required_fields: Sequence[str], group_size: int = 1) -> None:
        self.tasks[name] = list(required_fields)

    def partition(self, name: str) -> PartitionInfo:
        with self._lock:
            p = self._get(name)
            tasks = [
                SimpleNamespace(task=t, consumed=len(rows), lost=len(p.lost.get(t, ())))
                for t, rows in p.consumed.items()
            ]
            return PartitionInfo(name, len(p.rows), p.sealed, len(p.rows), tasks, p.lost_rows)

    def put(self, partition: str, columns: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[int]:
        p = self._get(partition)
        n = len(next(iter(columns.values())))
        with self._lock:
            if rows is None:
                rows = list(range(len(p.rows), len(p.rows) + n))
                p.rows.extend({} for _ in range(n))
            for name, values in columns.items():
                for row, value in zip(rows, values):
                    if name in p.rows[row]:
                        raise TQError(grpc.StatusCode.ALREADY_EXISTS, f"row {row} already has {name}")
                    p.rows[row][name] = value
        return list(rows)

    def _ready_groups(self, partition: str, task: str) -> list[int]:
        """First rows of the groups `task` can claim: every field it needs, not consumed, not leased."""
        p, required = self._get(partition), self.tasks[task]
        taken = {r for part, t, rows in self.leases.values() if (part, t) == (partition, task) for r in rows}
        done = p.consumed.setdefault(task, set())
        return [
            r
            for r in range(0, len(p.rows) - len(p.rows) % p.group_size, p.group_size)
            if all(all(f in p.rows[r + k] for f in required) for k in range(p.group_size))
            and r not in done
            and r not in taken
        ]

    def _nothing_more(self, partition: str, task: str, ready: int) -> bool:
        """Sealed, and every row not yet consumed or leased is ready: as the controller, answer a claim with
        fewer than min_rows rather than wait for rows that cannot come."""
        p = self._get(partition)
        with self._lock:
            taken = sum(len(rows) for part, t, rows in self.leases.values() if (part, t) == (partition, task))
            return p.sealed and ready > 0 and ready + taken + len(p.consumed.setdefault(task, set())) >= len(p.rows)

    def _complete(self, partition: str, task: str) -> bool:
        p = self._get(partition)
        return p.sealed and len(p.consumed.setdefault(task, set())) == len(p.rows)

    def claim_rows(
        self,
        partition: str,
        task: str,
        batch_size: int,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        claim_key: str = "",
    ) -> SimpleNamespace:
        p = self._get(partition)
        ready = self.wait_ready(partition, task, max(min_rows, 1), wait_s).ready_rows
        if ready < min_rows and not self._nothing_more(partition, task, ready):
            return SimpleNamespace(
                partition=partition,
                task=task,
                lease_id="",
                rows=[],
                complete=self._complete(partition, task),
                group_size=p.group_size,
            )
        with self._lock:
            ready = self._ready_groups(partition, task)
            rows = [r + k for r in ready[: max(1, batch_size // p.group_size)] for k in range(p.group_size)]
            lease = f"lease-{next(self._ids)}" if rows else ""
            if rows:
                self.leases[lease] = (partition, task, rows)
            return SimpleNamespace(
                partition=partition,
                task=task,
                lease_id=lease,
                rows=rows,
                complete=not rows and self._complete(partition, task),
                group_size=p.group_size,
            )

    def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        padded: bool = False,
        pad_value: int = 0,
    ) -> Batch:
        claimed = self.claim_rows(partition, task, batch_size, wait_s, lease_s, min_rows)
        if not claimed.rows:
            return Batch(partition, [], {}, complete=claimed.complete)
        return self._batch(partition, claimed.rows, list(fields or self.tasks[task]), claimed.lease_id)

    def wait_ready(self, partition: str, task: str, min_rows: int, wait_s: float) -> Ready:
        with self._lock:
            ready = len(self._ready_groups(partition, task)) * self._get(partition).group_size
            complete = ready == 0 and self._complete(partition, task)
        if ready < min_rows and not complete and wait_s > 0:
            time.sleep(min(wait_s, 0.01))  # a long poll, briefly: the caller loops
        return Ready(ready, complete)

    def release(self, lease: str | Batch) -> int:
        lease_id = lease.lease_id if isinstance(lease, Batch) else lease
        with self._lock:
            partition, task, held = self.leases.pop(lease_id)
            gone = self.lost_under.pop(lease_id, set())
            self._lose(self._get(partition), task, gone)
            return len(held) - len(gone)

    def read_claimed(self, claimed, fields: Sequence[str], padded: bool = False, pad_value: int = 0) -> Batch:
        return self._batch(claimed.partition, list(claimed.rows), list(fields), claimed.lease_id)

    def get(
        self, partition: str, rows: Sequence[int], fields: Sequence[str], padded: bool = False, pad_value: int = 0
    ) -> Batch:
        return self._batch(partition, list(rows), list(fields), "")

    def ack(self, lease: str | Batch, rows: Sequence[int] = ()) -> int:
        lease_id = lease.lease_id if isinstance(lease, Batch) else lease
        with self._lock:
            partition, task, leased = self.leases.pop(lease_id)
            self.lost_under.pop(lease_id, None)
            self._get(partition).consumed.setdefault(task, set()).update(leased)
            self.acks.append((partition, task, list(leased)))
        return len(leased)

    def reset_task(self, partition: str, task: str) -> int:
        """The task starts the partition over: nothing of it consumed, its leases dropped."""
        with self._lock:
            self._get(partition).consumed[task] = set()
            for lease in [k for k, (p, t, _) in self.leases.items() if (p, t) == (partition, task)]:
                del self.leases[lease]
            return len(self._ready_groups(partition, task)) * self._get(partition).group_size

    def clear_partition(self, name: str) -> bool:
        with self._lock:
            existed = self.partitions.pop(name, None) is not None
            self.cleared.append(name)
            return existed

    def close(self) -> None:
        pass

    def _batch(self, partition: str, rows: list[int], fields: list[str], lease: str) -> Batch:
        """Columns as the real decoder gives them: a tensor for scalars, a list of tensors for ragged fields."""
        p = self._get(partition)
        columns = {}
        for name in fields:
            values = [p.rows[r][name] for r in rows]
            scalar = all(torch.as_tensor(v).dim() == 0 for v in values)
            columns[name] = (
                torch.stack([torch.as_tensor(v) for v in values]) if scalar else [torch.as_tensor(v) for v in values]
            )
        return Batch(partition=partition, rows=rows, columns=columns, lease_id=lease)


class AsyncInMemoryDataPlane:
    """The rollout's asyncio data plane (AsyncDataPlane) over an InMemoryDataPlane, which the test reads."""

    def __init__(self, plane: InMemoryDataPlane):
        self.plane = plane
        self.closed = False

    async def create_partition(
        self, name: str, group_size: int = 1, exist_ok: bool = False, placement_block: int = 0
    ) -> None:
        self.plane.create_partition(name, group_size, exist_ok)

    async def list_partitions(self, prefix: str = "") -> list[PartitionInfo]:
        return [self.plane.partition(name) for name in sorted(self.plane.partitions) if name.startswith(prefix)]

    async def seal_partition(self, name: str) -> None:
        self.plane.seal_partition(name)

    async def register_task(self, name: str, required_fields: Sequence[str], group_size: int = 1) -> None:
        self.plane.register_task(name, required_fields, group_size)

    async def put(self, partition: str, columns: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[int]:
        return self.plane.put(partition, columns, rows)

    async def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        padded: bool = False,
        pad_value: int = 0,
    ) -> Batch:
        return self.plane.claim(partition, task, batch_size, fields)

    async def release(self, lease: str | Batch) -> int:
        return self.plane.release(lease)

    async def lost_rows(self, partition: str, task: str) -> list[int]:
        return sorted(self.plane._get(partition).lost.get(task, ()))

    async def close(self) -> None:
        self.closed = True
