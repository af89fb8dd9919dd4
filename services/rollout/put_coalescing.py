"""Group commit for the rollout's writes: groups that finish while a put to the same partition is in flight
go together in the next put, instead of one put each.

A put is three round trips (reserve rows at the controller, stream the Arrow batch to the shard, commit), and
its cost barely depends on how many rows it carries; a step's groups, admitted together when the weight
version moves, tend to finish within a few milliseconds of each other. The first group of a burst is written
at once (no added latency when groups arrive one at a time); those that finish during its put wait for it
and share the next one. Each caller's `put` returns its group's rows (or raises) when the put holding its
group does.

With `linger_s` > 0 the writer also waits, up to that long, for the partition's other groups still generating
(announced with `expect`, each settled by its `put` or `abandon`), so that a burst goes out as one put instead
of the first group's put followed by one for the rest: the rows of a step are trained together, so holding
the first groups back until their siblings finish costs the trainer nothing, and the step's rows arrive one
put (~6-10 ms on two loaded cores) sooner."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

Columns = dict[str, Any]


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


def _row_count(columns: Columns) -> int:
    first = next(iter(columns.values()))
    return int(first.shape[0]) if isinstance(first, torch.Tensor) else len(first)


@dataclass
class _Partition:
    queued: list[tuple[Columns, asyncio.Future]] = field(default_factory=list)
    writer: asyncio.Task | None = None
    expected: int = 0  # groups announced by expect() and not yet put or abandoned
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # a group was queued or abandoned


class PutCoalescer:
    """`put(partition, columns)` through one writer per partition; `write(partition, columns)` is the data
    plane's put."""

    def __init__(self, write: Callable[[str, Columns], Awaitable[Any]], linger_s: float = 0.0):
        self.write = write
        self.linger_s = linger_s
        self.partitions: dict[str, _Partition] = {}
        self.puts = 0  # puts sent (for metrics and tests)

    def expect(self, partition: str) -> None:
        """A group of `partition` started generating: its `put` or `abandon` follows."""
        self.partitions.setdefault(partition, _Partition()).expected += 1

    def abandon(self, partition: str) -> None:
        """An expected group will not be written (it failed or the rollout is stopping)."""
        state = self._settle(partition)
        if state.writer is None and not state.queued and state.expected == 0:
            self.partitions.pop(partition, None)

    def _settle(self, partition: str) -> _Partition:
        state = self.partitions.setdefault(partition, _Partition())
        state.expected = max(state.expected - 1, 0)
        state.arrived.set()
        return state

    async def put(self, partition: str, columns: Columns) -> list[int] | None:
        """Write the group's columns (an expected group's arrival; a group never expected is welcome too);
        -> the rows they were written to (None if the data plane's put returns none)."""
        state = self._settle(partition)
        done = asyncio.get_running_loop().create_future()
        state.queued.append((columns, done))
        if state.writer is None:
            state.writer = asyncio.ensure_future(self._drain(partition, state))
        return await done

    async def _linger(self, state: _Partition) -> None:
        """Wait, at most linger_s, while groups of the partition are still generating."""
        deadline = asyncio.get_running_loop().time() + self.linger_s
        while state.expected > 0:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            state.arrived.clear()
            try:
                await asyncio.wait_for(state.arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _drain(self, partition: str, state: _Partition) -> None:
        try:
            while state.queued:
                await self._linger(state)
                batch, state.queued = state.queued, []
                try:
                    self.puts += 1
                    rows = await self.write(partition, merge_columns([columns for columns, _ in batch]))
                except BaseException as exc:  # every group of the put learns of its failure
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                offset = 0
                for columns, done in batch:  # each group's rows, in the merged order
                    n = _row_count(columns)
                    if not done.done():
                        done.set_result(None if rows is None else list(rows[offset : offset + n]))
                    offset += n
        finally:
            for _, done in state.queued:  # cancelled (the rollout is stopping): nobody waits forever
                done.cancel()
            state.queued, state.writer = [], None
            if state.expected == 0:  # groups still generating keep their count for the next writer
                self.partitions.pop(partition, None)
