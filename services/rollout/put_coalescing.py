"""Group commit for the rollout's writes: groups that finish while a put to the same partition is in flight
go together in the next put, instead of one put each.

A put is three round trips (reserve rows at the controller, stream the Arrow batch to the shard, commit), and
its cost barely depends on how many rows it carries; a step's groups, admitted together when the weight
version moves, tend to finish within a few milliseconds of each other. The first group of a burst is written
at once (no added latency when groups arrive one at a time); those that finish during its put wait for it
and share the next one. Each caller's `put` returns (or raises) when the put holding its group does."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

Columns = dict[str, object]


def merge_columns(parts: list[Columns]) -> Columns:
    """Row-wise concatenation of column dicts with the same fields: tensors are concatenated along rows,
    lists (ragged fields) extended."""
    if len(parts) == 1:
        return parts[0]
    names = list(parts[0])
    if any(list(p) != names for p in parts):
        raise ValueError("the groups written together must have the same fields")
    merged: Columns = {}
    for name in names:
        values = [p[name] for p in parts]
        if isinstance(values[0], torch.Tensor):
            merged[name] = torch.cat(values)
        else:
            merged[name] = [v for part in values for v in part]
    return merged


@dataclass
class _Partition:
    queued: list[tuple[Columns, asyncio.Future]] = field(default_factory=list)
    writer: asyncio.Task | None = None


class PutCoalescer:
    """`put(partition, columns)` through one writer per partition; `write(partition, columns)` is the data
    plane's put."""

    def __init__(self, write: Callable[[str, Columns], Awaitable[object]]):
        self.write = write
        self.partitions: dict[str, _Partition] = {}
        self.puts = 0  # puts sent (for metrics and tests)

    async def put(self, partition: str, columns: Columns) -> None:
        state = self.partitions.setdefault(partition, _Partition())
        done = asyncio.get_running_loop().create_future()
        state.queued.append((columns, done))
        if state.writer is None:
            state.writer = asyncio.ensure_future(self._drain(partition, state))
        await done

    async def _drain(self, partition: str, state: _Partition) -> None:
        try:
            while state.queued:
                batch, state.queued = state.queued, []
                try:
                    self.puts += 1
                    await self.write(partition, merge_columns([columns for columns, _ in batch]))
                except BaseException as exc:  # every group of the put learns of its failure
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            for _, done in state.queued:  # cancelled (the rollout is stopping): nobody waits forever
                done.cancel()
            self.partitions.pop(partition, None)
