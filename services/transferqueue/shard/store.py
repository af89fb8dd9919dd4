"""In-memory Arrow storage of one shard: field data by (partition, row).

Each put keeps its Arrow arrays as they arrived (no per-row Python objects). A field column maps
row -> (chunk, offset) with numpy index arrays; reads of rows that sit contiguously in one chunk
are zero-copy slices, anything else is one `take` per chunk. Budgets are enforced before anything
is stored, so a put is all-or-nothing. With a journal (shard/journal.py) every change is written to
it, under the store's lock and before it is applied, so the journal's order is the store's.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import grpc
import numpy as np
import pyarrow as pa

from services.transferqueue.errors import TQError
from services.transferqueue.shard.journal import DELETE, DROP, PUT, Record, ShardJournal
from services.transferqueue.wire_format import from_untrusted_ipc, to_ipc


def _storage(array: pa.Array) -> pa.Array:
    return array.storage if isinstance(array, pa.ExtensionArray) else array


def _wrap(like_type: pa.DataType, storage: pa.Array) -> pa.Array:
    if isinstance(like_type, pa.ExtensionType):
        return pa.ExtensionArray.from_storage(like_type, storage)
    return storage


class FieldColumn:
    """One field's cells. Chunks may differ in type while uncommitted writers race; the controller
    admits one schema per field, so the committed rows a read asks for always share one type."""

    def __init__(self):
        self.chunks: list[Any] = []  # (array, its arrow field) per chunk; None once every cell of it is gone
        self.live: list[int] = []  # cells still pointing at each chunk
        self.nbytes: list[int] = []
        self.chunk_of = np.full(0, -1, dtype=np.int64)
        self.offset_of = np.zeros(0, dtype=np.int64)

    def _grow(self, size: int) -> None:
        if size > len(self.chunk_of):
            new = max(size, 2 * len(self.chunk_of), 1024)
            self.chunk_of = np.concatenate([self.chunk_of, np.full(new - len(self.chunk_of), -1, np.int64)])
            self.offset_of = np.concatenate([self.offset_of, np.zeros(new - len(self.offset_of), np.int64)])

    def has(self, rows: np.ndarray) -> np.ndarray:
        inside = rows < len(self.chunk_of)
        out = np.zeros(len(rows), dtype=bool)
        out[inside] = self.chunk_of[rows[inside]] >= 0
        return out

    def _unref(self, chunk_ids: np.ndarray) -> int:
        freed = 0
        ids, counts = np.unique(chunk_ids[chunk_ids >= 0], return_counts=True)
        for cid, n in zip(ids.tolist(), counts.tolist()):
            self.live[cid] -= n
            if self.live[cid] == 0:
                self.chunks[cid] = None
                freed += self.nbytes[cid]
        return freed

    def put(self, rows: np.ndarray, array: pa.Array, arrow_field: pa.Field) -> int:
        """Store; returns bytes freed by overwritten chunks."""
        self._grow(int(rows.max()) + 1)
        freed = self._unref(self.chunk_of[rows].copy())
        cid = len(self.chunks)
        self.chunks.append((array, arrow_field))
        self.live.append(len(rows))
        self.nbytes.append(array.nbytes)
        self.chunk_of[rows] = cid
        self.offset_of[rows] = np.arange(len(rows))
        return freed

    def delete(self, rows: np.ndarray) -> tuple[int, int]:
        rows = rows[self.has(rows)]
        freed = self._unref(self.chunk_of[rows].copy())
        self.chunk_of[rows] = -1
        return len(rows), freed

    def get(self, rows: np.ndarray) -> tuple[pa.Array, pa.Field]:
        cids = self.chunk_of[rows]
        offs = self.offset_of[rows]
        first = int(cids[0])
        chunk, arrow_field = self.chunks[first]
        if (cids == first).all():
            start = int(offs[0])
            if (offs == np.arange(start, start + len(rows))).all():
                return chunk.slice(start, len(rows)), arrow_field  # zero-copy
            return _wrap(chunk.type, _storage(chunk).take(pa.array(offs))), arrow_field
        parts, order = [], []
        for cid in np.unique(cids).tolist():
            sel = np.nonzero(cids == cid)[0]
            parts.append(_storage(self.chunks[cid][0]).take(pa.array(offs[sel])))
            order.append(sel)
        merged = pa.concat_arrays(parts)
        inverse = np.empty(len(rows), dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(len(rows))
        return _wrap(arrow_field.type, merged.take(pa.array(inverse))), arrow_field

    @property
    def empty(self) -> bool:
        return not any(self.live)


class PartitionData:
    def __init__(self):
        self.fields: dict[str, FieldColumn] = {}
        self.row_present = np.zeros(0, dtype=bool)
        self.rows = 0
        self.bytes = 0
        self.created = time.time()

    def mark_rows(self, rows: np.ndarray) -> int:
        if len(rows) and int(rows.max()) >= len(self.row_present):
            new = max(int(rows.max()) + 1, 2 * len(self.row_present), 1024)
            self.row_present = np.concatenate([self.row_present, np.zeros(new - len(self.row_present), bool)])
        fresh = int((~self.row_present[rows]).sum())
        self.row_present[rows] = True
        self.rows += fresh
        return fresh

    def new_rows(self, rows: np.ndarray) -> int:
        inside = rows < len(self.row_present)
        return int(len(rows) - self.row_present[rows[inside]].sum())


class ShardStore:
    """Thread-safe; every public method is atomic with respect to the others."""

    def __init__(self, max_rows: int, max_bytes: int, journal: ShardJournal | None = None):
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.rows = 0
        self.bytes = 0
        self.partitions: dict[str, PartitionData] = {}
        self.journal = journal
        self._lock = threading.Lock()

    def put(self, partition: str, rows: np.ndarray, table: pa.Table, ipc=None) -> int:
        """Store `table` at `rows`; `ipc` is the Arrow IPC stream it was read from (for the journal)."""
        if len(rows) != table.num_rows:
            raise TQError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"header names {len(rows)} rows but the Arrow data has {table.num_rows}",
            )
        if len(np.unique(rows)) != len(rows) or (len(rows) and rows.min() < 0):
            raise TQError(grpc.StatusCode.INVALID_ARGUMENT, "row indices must be distinct and >= 0")
        nbytes = sum(col.nbytes for col in table.columns)
        if len(rows) > self.max_rows or nbytes > self.max_bytes:
            raise TQError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"put of {len(rows)} rows and {nbytes} bytes exceeds the shard's whole budget "
                f"({self.max_rows} rows, {self.max_bytes} bytes): split it",
            )
        with self._lock:
            part = self.partitions.get(partition)
            fresh = part.new_rows(rows) if part else len(rows)
            if self.rows + fresh > self.max_rows or self.bytes + nbytes > self.max_bytes:
                raise TQError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"shard full: holds {self.rows}/{self.max_rows} rows and {self.bytes}/{self.max_bytes} "
                    f"bytes; this put adds {fresh} rows and {nbytes} bytes",
                )
            if self.journal is not None:
                self.journal.record_put(partition, rows, ipc if ipc is not None else to_ipc(table))
            if part is None:
                part = self.partitions[partition] = PartitionData()
            freed = 0
            for i, arrow_field in enumerate(table.schema):
                column = part.fields.get(arrow_field.name)
                if column is None:
                    column = part.fields[arrow_field.name] = FieldColumn()
                chunk = table.column(i)
                chunk = chunk.combine_chunks() if chunk.num_chunks != 1 else chunk.chunk(0)
                freed += column.put(rows, chunk, arrow_field)
            self.rows += part.mark_rows(rows)
            part.bytes += nbytes - freed
            self.bytes += nbytes - freed
            self._compact_if_due()
            return nbytes

    def get(self, partition: str, rows: np.ndarray, fields: list[str]) -> pa.Table:
        with self._lock:
            part = self.partitions.get(partition)
            if part is None:
                raise TQError(grpc.StatusCode.NOT_FOUND, f"partition {partition} has no data on this shard")
            arrays, schema = [], []
            for name in fields:
                column = part.fields.get(name)
                if column is None or column.empty:
                    raise TQError(
                        grpc.StatusCode.NOT_FOUND, f"field {name} of partition {partition} is not stored here"
                    )
                have = column.has(rows)
                if not have.all():
                    missing = rows[~have][:5].tolist()
                    raise TQError(
                        grpc.StatusCode.NOT_FOUND,
                        f"field {name} of rows {missing} in partition {partition} is not stored here",
                    )
                array, arrow_field = column.get(rows)
                arrays.append(array)
                schema.append(arrow_field)
            return pa.Table.from_arrays(arrays, schema=pa.schema(schema))

    def delete(self, partition: str, rows: np.ndarray, fields: list[str]) -> int:
        with self._lock:
            part = self.partitions.get(partition)
            if part is None:
                return 0
            if self.journal is not None:
                self.journal.record_delete(partition, rows, fields)
            cells = freed = 0
            for name in fields:
                column = part.fields.get(name)
                if column is not None:
                    n, f = column.delete(rows)
                    cells += n
                    freed += f
            part.bytes -= freed
            self.bytes -= freed
            # rows left with no field at all no longer count against the budget
            inside = rows[rows < len(part.row_present)]
            inside = inside[part.row_present[inside]]
            if len(inside):
                keep = np.zeros(len(inside), dtype=bool)
                for column in part.fields.values():
                    keep |= column.has(inside)
                gone = inside[~keep]
                part.row_present[gone] = False
                part.rows -= len(gone)
                self.rows -= len(gone)
            return cells

    def drop(self, partition: str) -> tuple[bool, int]:
        with self._lock:
            part = self.partitions.pop(partition, None)
            if part is None:
                return False, 0
            if self.journal is not None:
                self.journal.record_drop(partition)
                self._compact_if_due()
            self.rows -= part.rows
            self.bytes -= part.bytes
            return True, part.bytes

    def partition_names(self) -> list[str]:
        with self._lock:
            return sorted(self.partitions)

    def created(self, partition: str) -> float | None:
        with self._lock:
            part = self.partitions.get(partition)
            return part.created if part else None

    def replay(self, records: list[Record], max_row_elements: int) -> None:
        """Apply a journal's records (at start, before serving); nothing is journaled again."""
        journal, self.journal = self.journal, None
        try:
            for rec in records:
                if rec.kind == PUT:  # its own buffer: a slice of the journal would keep the whole file alive
                    self.put(rec.partition, rec.rows, from_untrusted_ipc(bytearray(rec.payload), max_row_elements))
                elif rec.kind == DELETE:
                    self.delete(rec.partition, rec.rows, rec.fields)
                elif rec.kind == DROP:
                    self.drop(rec.partition)
        finally:
            self.journal = journal

    def _compact_if_due(self) -> None:
        if self.journal is not None and self.journal.needs_compaction(self.bytes):
            self.journal.compact(self._snapshot)

    def _snapshot(self) -> Iterator[tuple[str, np.ndarray, pa.Buffer]]:
        """What the store holds, as one put per (partition, field); called under the lock."""
        for name, part in self.partitions.items():
            for column in part.fields.values():
                # chunk by chunk: racing uncommitted writers may have left chunks of different types
                for cid in np.unique(column.chunk_of[column.chunk_of >= 0]).tolist():
                    rows = np.nonzero(column.chunk_of == cid)[0]
                    array, arrow_field = column.get(rows)
                    yield name, rows, to_ipc(pa.Table.from_arrays([array], schema=pa.schema([arrow_field])))
