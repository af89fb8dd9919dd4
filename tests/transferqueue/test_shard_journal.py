"""The shard's write-ahead journal: a store rebuilt from it holds exactly what the old one held, a torn
tail is cut away without losing what came before, compaction keeps the contents, one directory serves
one shard, and the incarnation of its data changes exactly when acknowledged puts may be gone."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from services.transferqueue.codec import encode_columns
from services.transferqueue.shard.journal import FILE_NAME, ShardJournal
from services.transferqueue.shard.store import ShardStore
from services.transferqueue.wire_format import to_ipc

MAX_ELEMENTS = 1 << 20


def _table(values: list[int], name: str = "x") -> pa.Table:
    """A table as the client encodes it (the wire format's metadata included)."""
    _, _, batch = encode_columns({name: torch.tensor(values, dtype=torch.int64)})
    return pa.Table.from_batches([batch])


def _store(directory, compact_bytes: int = 256 << 20) -> ShardStore:
    journal = ShardJournal(str(directory), compact_bytes=compact_bytes)
    store = ShardStore(10_000, 1 << 30, journal)
    records, _ = journal.replay()
    store.replay(records, MAX_ELEMENTS)
    return store


def _contents(store: ShardStore) -> dict:
    """partition -> field -> {row: value}: everything a reader could get."""
    out = {}
    for name, part in store.partitions.items():
        for field, column in part.fields.items():
            rows = np.nonzero(column.chunk_of >= 0)[0]
            if len(rows):
                values = store.get(name, rows, [field]).column(0).to_pylist()
                out.setdefault(name, {})[field] = dict(zip(rows.tolist(), values))
    return out


def _put(store: ShardStore, partition: str, rows: list[int], values: list[int], name: str = "x") -> None:
    table = _table(values, name)
    store.put(partition, np.array(rows, dtype=np.int64), table, ipc=to_ipc(table))


def _close(store: ShardStore) -> None:
    store.journal.close()


def test_a_restarted_store_holds_what_the_old_one_held(tmp_path):
    store = _store(tmp_path)
    _put(store, "a", [0, 1, 2, 3], [10, 11, 12, 13])
    _put(store, "a", [0, 1, 2, 3], [20, 21, 22, 23], name="y")
    _put(store, "a", [2], [99])  # overwrite
    store.delete("a", np.array([1]), ["x", "y"])  # row 1 gone entirely
    store.delete("a", np.array([3]), ["y"])
    _put(store, "b", [5, 6], [1, 2])
    store.drop("b")
    _put(store, "c", [0], [7])
    before, rows, nbytes = _contents(store), store.rows, store.bytes
    _close(store)

    again = _store(tmp_path)
    assert _contents(again) == before == {"a": {"x": {0: 10, 2: 99, 3: 13}, "y": {0: 20, 2: 22}}, "c": {"x": {0: 7}}}
    assert (again.rows, again.bytes) == (rows, nbytes)
    _close(again)


def test_a_torn_tail_is_cut_and_what_came_before_is_kept(tmp_path):
    store = _store(tmp_path)
    _put(store, "a", [0, 1], [1, 2])
    _close(store)
    path = os.path.join(tmp_path, FILE_NAME)
    whole = os.path.getsize(path)
    store = _store(tmp_path)
    _put(store, "a", [2, 3], [3, 4])
    _close(store)
    with open(path, "r+b") as f:  # the second record cut mid-way, as a crash during the write leaves it
        f.truncate(whole + 20)

    journal = ShardJournal(str(tmp_path))
    records, report = journal.replay()
    assert (report.records, report.torn_bytes) == (1, 20)
    assert os.path.getsize(path) == whole  # the torn bytes are gone from the file too
    journal.close()
    again = _store(tmp_path)
    assert _contents(again) == {"a": {"x": {0: 1, 1: 2}}}
    _put(again, "a", [4], [5])  # appending after the cut works
    _close(again)
    assert _contents(_store(tmp_path)) == {"a": {"x": {0: 1, 1: 2, 4: 5}}}


def test_a_corrupt_record_ends_the_replay(tmp_path):
    store = _store(tmp_path)
    _put(store, "a", [0], [1])
    _put(store, "a", [1], [2])
    _close(store)
    path = os.path.join(tmp_path, FILE_NAME)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))  # a flipped byte in the last record's payload fails its CRC
    assert _contents(_store(tmp_path)) == {"a": {"x": {0: 1}}}


def test_compaction_rewrites_the_journal_to_what_is_held(tmp_path):
    store = _store(tmp_path, compact_bytes=64 << 10)
    payload = list(range(1000))
    for i in range(40):  # 40 overwrites of the same rows, and partitions that come and go
        _put(store, "keep", list(range(1000)), [v + i for v in payload])
        _put(store, f"gone-{i}", [0, 1], [i, i])
        store.drop(f"gone-{i}")
    written = 40 * 1000 * 8
    assert store.journal.size < written / 4  # compacted, not 40 copies
    before = _contents(store)
    _close(store)
    again = _store(tmp_path, compact_bytes=64 << 10)
    assert _contents(again) == before and set(before) == {"keep"}
    assert before["keep"]["x"][999] == 999 + 39
    _close(again)


def test_one_directory_serves_one_shard(tmp_path):
    first = ShardJournal(str(tmp_path))
    with pytest.raises(RuntimeError, match="in use"):
        ShardJournal(str(tmp_path))
    first.close()
    ShardJournal(str(tmp_path)).close()  # free again once the first is closed (or its process dies)


def _incarnation(directory, fsync: bool = False) -> str:
    journal = ShardJournal(str(directory), fsync=fsync)
    try:
        return journal.incarnation()
    finally:
        journal.close()


def test_the_incarnation_stays_while_the_journal_holds_every_acknowledged_put(tmp_path, monkeypatch):
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    monkeypatch.setattr("services.transferqueue.shard.journal.BOOT_ID", str(boot))
    first = _incarnation(tmp_path / "d")
    assert _incarnation(tmp_path / "d") == first  # a restarted process: the page cache kept the journal
    boot.write_text("boot-2\n")  # the machine restarted: without fsync, acknowledged puts may be gone
    second = _incarnation(tmp_path / "d")
    assert second != first
    boot.write_text("boot-3\n")
    assert _incarnation(tmp_path / "d", fsync=True) == second  # with fsync every acknowledged put survives
    os.remove(tmp_path / "d" / FILE_NAME)  # the journal lost (its disk replaced)
    assert _incarnation(tmp_path / "d", fsync=True) not in (first, second)
    assert _incarnation(tmp_path / "e") != _incarnation(tmp_path / "f")  # new journals, new incarnations
