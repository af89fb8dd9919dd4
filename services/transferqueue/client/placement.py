"""Which shard holds a row, and how a put or read is split across shards (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Placement:
    shard_ids: tuple[str, ...]
    block: int

    @classmethod
    def of(cls, info) -> "Placement":
        return cls(tuple(info.shard_ids), int(info.placement_block))

    def shard_index(self, rows: np.ndarray) -> np.ndarray:
        """shard_of(row) = shard_ids[(row // block) % len(shard_ids)] (the contract in the .proto)."""
        return (rows // self.block) % len(self.shard_ids)

    def split(self, rows) -> list[tuple[str, np.ndarray]]:
        """[(shard id, positions into `rows`)] for the shards that hold any of the rows."""
        rows = np.asarray(rows, dtype=np.int64)
        idx = self.shard_index(rows)
        if len(rows) and (idx == idx[0]).all():
            return [(self.shard_ids[int(idx[0])], np.arange(len(rows)))]
        return [(self.shard_ids[s], np.nonzero(idx == s)[0]) for s in np.unique(idx).tolist()]


def select(batch: pa.RecordBatch, positions: np.ndarray) -> pa.RecordBatch:
    """Rows at `positions`; a zero-copy slice when they are contiguous (the usual case)."""
    if len(positions) == batch.num_rows:
        return batch
    start = int(positions[0])
    if positions[-1] - start == len(positions) - 1:
        return batch.slice(start, len(positions))
    return batch.take(pa.array(positions))


def merge_in_order(parts: list[tuple[np.ndarray, pa.Table]], n_rows: int) -> pa.Table:
    """Reassemble per-shard tables (each for `positions` of the request) in request order."""
    if len(parts) == 1:
        return parts[0][1]
    table = pa.concat_tables([t for _, t in parts])
    order = np.concatenate([p for p, _ in parts])
    inverse = np.empty(n_rows, dtype=np.int64)
    inverse[order] = np.arange(n_rows)
    return table.take(pa.array(inverse))
