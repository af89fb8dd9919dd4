"""A shard's write-ahead journal: every accepted put, delete and drop, appended in the order the store
applied them, so that a shard killed with kill -9 and started again on the same `--data-dir` replays it
and holds exactly the rows it had acknowledged.

Why a journal and not replicas: a replica doubles every put's network bytes and needs a second shard
to agree with; the journal costs one sequential write of bytes the shard already holds in one buffer
(the put's Arrow IPC stream), and a supervised shard is back in seconds. docs/operations.md has the
measured put cost.

Record layout (little-endian): a fixed head `magic | kind | header length | row count | payload length |
crc32`, then a JSON header (the partition, the fields of a delete), the rows as int64 and the payload
(a put's Arrow IPC stream, as received). The CRC covers everything after the head, so a record cut off
by a crash (a torn tail) is found on replay and cut away; nothing before it is lost. With
`fsync=False` (the default) a record is in the page cache when the put is acknowledged: that survives
the shard process dying, not the machine; `fsync=True` survives both at the cost of a sync per write.

The journal only grows while partitions live; when it is more than twice the bytes the store holds
(and over `compact_bytes`), it is rewritten as one put per (partition, field) of what the store holds.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"SJ01"
HEAD = struct.Struct("<4sBIQQI")
PUT, DELETE, DROP = 1, 2, 3
FILE_NAME = "journal.sj"
INCARNATION_FILE = "incarnation"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass
class Record:
    kind: int
    partition: str
    rows: np.ndarray
    fields: list[str]
    payload: memoryview


@dataclass
class ReplayReport:
    records: int = 0
    bytes: int = 0
    torn_bytes: int = 0  # cut from the end: a record the crash interrupted


def _encode(kind: int, partition: str, rows: np.ndarray, fields: Iterable[str], payload) -> list:
    header = json.dumps({"partition": partition, "fields": list(fields)}).encode()
    rows_bytes = np.ascontiguousarray(rows, dtype="<i8").tobytes()
    payload = memoryview(payload) if payload is not None else memoryview(b"")
    crc = zlib.crc32(payload, zlib.crc32(rows_bytes, zlib.crc32(header)))
    head = HEAD.pack(MAGIC, kind, len(header), len(rows_bytes) // 8, payload.nbytes, crc)
    return [head, header, rows_bytes, payload]


def read_records(data: memoryview) -> tuple[list[Record], int]:
    """The whole records at the start of `data` and where they end (a torn or corrupt record ends it)."""
    records, pos = [], 0
    while pos + HEAD.size <= len(data):
        magic, kind, header_len, n_rows, payload_len, crc = HEAD.unpack_from(data, pos)
        end = pos + HEAD.size + header_len + 8 * n_rows + payload_len
        if magic != MAGIC or kind not in (PUT, DELETE, DROP) or end > len(data):
            break
        start = pos + HEAD.size
        header, rows = data[start : start + header_len], data[start + header_len : start + header_len + 8 * n_rows]
        payload = data[start + header_len + 8 * n_rows : end]
        if zlib.crc32(payload, zlib.crc32(rows, zlib.crc32(header))) != crc:
            break
        meta = json.loads(bytes(header))
        records.append(
            Record(
                kind,
                meta["partition"],
                np.frombuffer(rows, dtype="<i8").astype(np.int64),
                list(meta["fields"]),
                payload,
            )
        )
        pos = end
    return records, pos


class ShardJournal:
    """One shard's journal in `directory` (held with an exclusive lock: two shards on one directory
    would interleave their records)."""

    def __init__(self, directory: str, fsync: bool = False, compact_bytes: int = 256 << 20):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, FILE_NAME)
        self.fsync = fsync
        self.compact_bytes = compact_bytes
        self.directory = directory
        self.existed = os.path.exists(self.path)
        self._lock_file = open(os.path.join(directory, "journal.lock"), "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"--data-dir {directory} is in use by another shard") from None
        self._file = open(self.path, "ab")
        self.size = self._file.tell()

    def replay(self) -> tuple[list[Record], ReplayReport]:
        """The journal's records, oldest first; a torn tail is cut off the file."""
        with open(self.path, "rb") as f:
            data = memoryview(f.read())
        records, end = read_records(data)
        report = ReplayReport(records=len(records), bytes=end, torn_bytes=len(data) - end)
        if report.torn_bytes:
            log.warning("journal ends in a torn record; cutting it", extra={"bytes": report.torn_bytes})
            self._file.truncate(end)
            self._file.seek(end)
            self.size = end
        return records, report

    def incarnation(self) -> str:
        """The identity of the data this journal holds (RegisterShardRequest.incarnation). Kept while the
        journal holds every put it acknowledged; new when the journal is new (or its incarnation file is
        gone), and, without fsync, after the machine restarted (acknowledged records may have been lost with
        the page cache). A new one makes the controller mark every row placed on this shard lost."""
        path = os.path.join(self.directory, INCARNATION_FILE)
        boot = _boot_id()
        try:
            with open(path) as f:
                current, _, booted = f.read().split("\n", 1)[0].partition(" ")
        except (FileNotFoundError, ValueError):
            current = booted = ""
        if not (self.existed and current and (self.fsync or booted == boot)):
            current = uuid.uuid4().hex
        with open(path + ".tmp", "w") as f:
            f.write(f"{current} {boot}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        return current

    def _append(self, parts: list) -> None:
        for part in parts:
            self._file.write(part)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self.size += sum(memoryview(p).nbytes for p in parts)

    def record_put(self, partition: str, rows: np.ndarray, ipc) -> None:
        self._append(_encode(PUT, partition, rows, (), ipc))

    def record_delete(self, partition: str, rows: np.ndarray, fields: list[str]) -> None:
        self._append(_encode(DELETE, partition, rows, fields, None))

    def record_drop(self, partition: str) -> None:
        self._append(_encode(DROP, partition, np.zeros(0, np.int64), (), None))

    def needs_compaction(self, live_bytes: int) -> bool:
        return self.size > self.compact_bytes and self.size > 2 * live_bytes

    def compact(self, snapshot: Callable[[], Iterator[tuple[str, np.ndarray, bytes]]]) -> None:
        """Rewrite the journal as `snapshot`'s puts (partition, rows, IPC stream), atomically."""
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            for partition, rows, ipc in snapshot():
                for part in _encode(PUT, partition, rows, (), ipc):
                    f.write(part)
            f.flush()
            os.fsync(f.fileno())
        before = self.size
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")
        self.size = self._file.tell()
        log.info("journal compacted", extra={"bytes_before": before, "bytes_after": self.size})

    def close(self) -> None:
        self._file.close()
        self._lock_file.close()


def _boot_id() -> str:
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""
