"""Bounded, validated input on the data plane (issue #13): every rejected call gets a clear status naming
what was wrong and leaves every Redis key and every shard byte as it was. Real Redis, controller and
shard processes with small caps (tests/transferqueue/hardened_stack.py)."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pyarrow as pa
import pytest

from services.transferqueue.local_stack import LocalTransferQueue
from services.transferqueue.pb import transferqueue_pb2 as pb
from tests.transferqueue import hardened_stack as hs
from tests.transferqueue.hardened_stack import (
    MAX_LEASE_MS,
    PARTITION_ROWS,
    ROWS_PER_CALL,
    ipc,
    lying_offsets,
    put_chunks,
    scalar,
)

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

IA, RE, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    stack = hs.start(str(tmp_path_factory.mktemp("tq-bounds")))
    s = hs.Stubs(stack)
    c = s.controller
    c.CreatePartition(pb.CreatePartitionRequest(name="base", group_size=2))
    c.RegisterTask(pb.RegisterTaskRequest(name="tb", required_fields=["x"], group_size=2))
    yield s
    s.close()
    stack.stop()


def _put(s: hs.Stubs, partition: str, values: np.ndarray) -> list[int]:
    """A put by hand (prepare, shard put with the reservation, commit)."""
    prepared = s.controller.PreparePut(
        pb.PreparePutRequest(partition=partition, fields=[scalar("x")], new_rows=len(values))
    )
    data = ipc(("x", pa.array(values, type=pa.int64()), "int64"))
    s.shard.Put(put_chunks(partition, prepared.rows, data, prepared.reservation))
    s.controller.CommitPut(pb.CommitPutRequest(partition=partition, fields=[scalar("x")], rows=prepared.rows))
    return list(prepared.rows)


def _rejected(s: hs.Stubs, call, request, code: grpc.StatusCode, *words: str) -> str:
    """`call(request)` fails with `code`, a message holding every word, and no state changed."""
    before = s.snapshot()
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, timeout=10)
        if hasattr(result, "__next__"):  # a server stream: the error comes with the first message
            list(result)
    assert err.value.code() == code, err.value.details()
    for word in words:
        assert word in err.value.details(), err.value.details()
    assert s.snapshot() == before, f"state changed by a rejected call: {err.value.details()}"
    return err.value.details()


# 1, 6: counts, indices, lease lengths checked before any Redis function runs; bounded leases


def test_enormous_counts_and_leases_are_rejected_before_redis(stubs):
    s, c = stubs, stubs.controller
    _put(s, "base", np.arange(4))
    req = pb.PreparePutRequest
    _rejected(s, c.PreparePut, req(partition="base", fields=[scalar("x")], new_rows=2**62), IA, "new_rows")
    _rejected(s, c.PreparePut, req(partition="base", fields=[scalar("x")], new_rows=ROWS_PER_CALL + 2), IA, "new_rows")
    _rejected(
        s,
        c.PreparePut,
        req(partition="base", fields=[scalar("y")], rows=list(range(ROWS_PER_CALL + 1))),
        IA,
        "rows",
        "split it",
    )
    _rejected(
        s, c.CommitPut, pb.CommitPutRequest(partition="base", fields=[scalar("x")], rows=[2**53 + 1]), IA, "row index"
    )
    _rejected(s, c.Claim, pb.ClaimRequest(partition="base", task="tb", batch_size=2**40), IA, "batch_size")
    _rejected(s, c.Claim, pb.ClaimRequest(partition="base", task="tb", batch_size=2, lease_ms=2**62), IA, "lease_ms")
    _rejected(s, c.Claim, pb.ClaimRequest(partition="base", task="tb", batch_size=2, min_rows=-1), IA, "min_rows")
    _rejected(s, c.WaitReady, pb.WaitReadyRequest(partition="base", task="tb", min_rows=1, wait_ms=-5), IA, "wait_ms")
    _rejected(s, c.CreatePartition, pb.CreatePartitionRequest(name="big", group_size=2**40), IA, "group_size")
    _rejected(s, c.CreatePartition, pb.CreatePartitionRequest(name="big", placement_block=-3), IA, "placement_block")
    _rejected(
        s, c.RegisterTask, pb.RegisterTaskRequest(name="tt", required_fields=["x"], group_size=-2), IA, "group_size"
    )
    _rejected(s, c.RegisterShard, pb.RegisterShardRequest(shard_id="evil", address="h:1", ttl_ms=2**62), IA, "ttl_ms")
    claimed = c.Claim(pb.ClaimRequest(partition="base", task="tb", batch_size=2, lease_ms=MAX_LEASE_MS))
    assert claimed.rows and claimed.lease_expires_unix_ms <= time.time() * 1000 + MAX_LEASE_MS + 1000
    _rejected(
        s, c.ExtendLease, pb.ExtendLeaseRequest(lease_id=claimed.lease_id, lease_ms=MAX_LEASE_MS + 1), IA, "lease_ms"
    )
    _rejected(s, c.Ack, pb.AckRequest(lease_id=claimed.lease_id, rows=[-2, -1]), IA, "row index -2")
    assert c.Ack(pb.AckRequest(lease_id=claimed.lease_id)).rows_acked == 2


def test_allocation_partition_and_task_caps_are_resource_exhausted(stubs):
    s, c = stubs, stubs.controller
    c.CreatePartition(pb.CreatePartitionRequest(name="alloc"))
    for _ in range(PARTITION_ROWS // ROWS_PER_CALL):
        c.PreparePut(pb.PreparePutRequest(partition="alloc", fields=[scalar("x")], new_rows=ROWS_PER_CALL))
    _rejected(
        s,
        c.PreparePut,
        pb.PreparePutRequest(partition="alloc", fields=[scalar("x")], new_rows=2),
        RE,
        "--max-partition-rows",
    )
    names = [f"cap{i}" for i in range(60)]
    created = 0
    with pytest.raises(grpc.RpcError) as err:
        for name in names:
            c.CreatePartition(pb.CreatePartitionRequest(name=name))
            created += 1
    assert err.value.code() == RE and "--max-partitions" in err.value.details()
    _rejected(s, c.CreatePartition, pb.CreatePartitionRequest(name="one-more"), RE, "--max-partitions")
    for name in names[:created]:
        c.ClearPartition(pb.ClearPartitionRequest(name=name))


def test_a_lease_id_without_its_lease_never_wedges_a_task(stubs):
    """A lease left behind by a half-applied write (here planted by hand) is dropped at the next claim
    instead of failing every claim of the task with INTERNAL."""
    s, c = stubs, stubs.controller
    c.CreatePartition(pb.CreatePartitionRequest(name="wedge"))
    c.RegisterTask(pb.RegisterTaskRequest(name="tw", required_fields=["x"]))
    _put(s, "wedge", np.arange(2))
    s.redis.zadd("tq:p:wedge:t:tw:leases", {"deadbeef": 1})
    claimed = c.Claim(pb.ClaimRequest(partition="wedge", task="tw", batch_size=2))
    assert list(claimed.rows) == [0, 1]
    assert s.redis.zscore("tq:p:wedge:t:tw:leases", "deadbeef") is None


# 2: negative row indices never address other rows


def test_negative_rows_are_rejected_by_the_shard_and_read_and_delete_nothing(stubs):
    s = stubs
    s.controller.CreatePartition(pb.CreatePartitionRequest(name="neg"))
    rows = _put(s, "neg", np.array([10, 11, 12]))
    # a shard's row index arrays start at 1024 slots: -1024 was row 0 to numpy, -1023 row 1
    _rejected(s, s.shard.Get, pb.GetRequest(partition="neg", rows=[-1024], fields=["x"]), IA, "rows", "-1024")
    _rejected(s, s.shard.Get, pb.GetRequest(partition="neg", rows=[-1], fields=["x"]), IA, "rows", "-1")
    _rejected(s, s.shard.Delete, pb.DeleteRequest(partition="neg", rows=[-1023], fields=["x"]), IA, "rows", "-1023")
    _rejected(s, s.shard.Get, pb.GetRequest(partition="neg", rows=[PARTITION_ROWS], fields=["x"]), IA, "row index")
    got = b"".join(chunk.data for chunk in s.shard.Get(pb.GetRequest(partition="neg", rows=rows, fields=["x"])))
    assert pa.ipc.open_stream(got).read_all().column("x").to_pylist() == [10, 11, 12]


# 3: dtypes from an allow-list, bounded shapes, Arrow fully validated before it is stored


def test_dtypes_and_shapes_are_bounded(stubs):
    s, c = stubs, stubs.controller
    c.CreatePartition(pb.CreatePartitionRequest(name="shapes"))

    def prepare(field):
        return pb.PreparePutRequest(partition="shapes", fields=[field], new_rows=1)

    _rejected(s, c.PreparePut, prepare(pb.FieldSchema(name="z", dtype="complex128", kind=pb.SCALAR)), IA, "dtype")
    _rejected(s, c.PreparePut, prepare(pb.FieldSchema(name="z", dtype="string", kind=pb.SCALAR)), IA, "STRING")
    _rejected(
        s, c.PreparePut, prepare(pb.FieldSchema(name="z", dtype="int8", kind=pb.TENSOR, shape=[1] * 9)), IA, "shape"
    )
    _rejected(
        s,
        c.PreparePut,
        prepare(pb.FieldSchema(name="z", dtype="int8", kind=pb.TENSOR, shape=[2**31, 2**31])),
        IA,
        "elements per row",
    )
    _rejected(s, c.PreparePut, prepare(pb.FieldSchema(name="z", dtype="int8", kind=pb.SCALAR, shape=[3])), IA, "shape")
    _rejected(s, c.PreparePut, prepare(pb.FieldSchema(name="z", dtype="int8", kind=17)), IA, "kind")


def test_arrow_that_lies_is_rejected_before_it_is_stored(stubs):
    s = stubs
    s.controller.CreatePartition(pb.CreatePartitionRequest(name="arrow"))
    prepared = s.controller.PreparePut(pb.PreparePutRequest(partition="arrow", fields=[scalar("x")], new_rows=2))
    rows, res = list(prepared.rows), prepared.reservation
    cases = {
        "offsets past the values": lying_offsets([0, 2, 1 << 20]),
        "offsets going back": lying_offsets([0, 3, 1]),
        "nulls": ipc(("x", pa.array([1, None], type=pa.int64()), "int64")),
        "compressed": ipc(("x", pa.array(np.arange(2)), "int64"), compression="lz4"),
        "dtype": ipc(("x", pa.array([1.0, 2.0]), "int64")),
        "twice": ipc(("x", pa.array([1, 2]), "int64"), ("x", pa.array([1, 2]), "int64")),
    }
    for name, data in cases.items():
        details = _rejected(s, s.shard.Put, put_chunks("arrow", rows, data, res), IA)
        assert "column" in details or "Arrow" in details, (name, details)
    tensor = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8), type=pa.int8()), 4)
    wrong = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.int8(), [2, 2]), tensor)
    data = ipc(("x", wrong, "int8"))
    # a tensor type claiming a shape its storage does not hold: rebuild the type with a lie
    assert b"[2,2]" in data
    _rejected(s, s.shard.Put, put_chunks("arrow", rows, data.replace(b"[2,2]", b"[3,3]"), res), IA)


# 4: shards accept writes only for reservations the controller issued


def test_shard_accepts_only_reservations_the_controller_issued(stubs):
    s, c = stubs, stubs.controller
    for name in ("resv", "other"):
        c.CreatePartition(pb.CreatePartitionRequest(name=name))
    prepared = c.PreparePut(pb.PreparePutRequest(partition="resv", fields=[scalar("x")], new_rows=2))
    rows, res = list(prepared.rows), prepared.reservation
    data = ipc(("x", pa.array([5, 6], type=pa.int64()), "int64"))
    pd = grpc.StatusCode.PERMISSION_DENIED
    _rejected(s, s.shard.Put, put_chunks("resv", rows, data), pd, "no reservation")
    forged = res[:-1] + bytes([res[-1] ^ 1])
    _rejected(s, s.shard.Put, put_chunks("resv", rows, data, forged), pd, "not issued")
    _rejected(s, s.shard.Put, put_chunks("other", rows, data, res), pd, "not issued")
    _rejected(s, s.shard.Put, put_chunks("resv", [rows[0], rows[1] + 5], data, res), FP, "outside its reservation")
    assert s.shard.Put(put_chunks("resv", rows, data, res)).rows == 2


# 5: per-stream and per-response memory capped


def test_streams_responses_and_messages_are_capped(stubs):
    s, c = stubs, stubs.controller
    c.CreatePartition(pb.CreatePartitionRequest(name="big"))
    prepared = c.PreparePut(pb.PreparePutRequest(partition="big", fields=[scalar("x")], new_rows=2))
    data = ipc(("x", pa.array([1, 2], type=pa.int64()), "int64"))
    _rejected(
        s,
        s.shard.Put,
        put_chunks("big", prepared.rows, data, prepared.reservation, total=hs.PUT_BYTES + 1),
        RE,
        "--max-put-bytes",
    )
    _rejected(
        s,
        s.shard.Put,
        put_chunks("big", prepared.rows, data, prepared.reservation, total=len(data) - 1),
        RE,
        "announced",
    )
    # 64 rows x 1 KiB = 64 KiB stored over two puts; reading all 64 at once passes the 32 KiB response cap
    wide = pb.FieldSchema(name="w", dtype="int64", kind=pb.TENSOR, shape=[128])
    for _ in range(2):
        p = c.PreparePut(pb.PreparePutRequest(partition="big", fields=[wide], new_rows=32))
        storage = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(32 * 128, dtype=np.int64)), 128)
        column = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.int64(), [128]), storage)
        s.shard.Put(put_chunks("big", p.rows, ipc(("w", column, "int64")), p.reservation))
        last = list(p.rows)
    _rejected(
        s,
        s.shard.Get,
        pb.GetRequest(partition="big", rows=list(range(2, 66)), fields=["w"]),
        RE,
        "--max-response-bytes",
    )
    assert len(b"".join(ch.data for ch in s.shard.Get(pb.GetRequest(partition="big", rows=last[:16], fields=["w"]))))
    oversized = s.raw_controller("ListTasks")
    _rejected(s, oversized, b"\x0a" + b"\x80\x80\x40" + b"x" * (hs.CONTROLLER_MESSAGE_BYTES + 16), RE)


def test_a_late_task_or_a_reset_over_more_rows_than_allowed_is_refused_before_any_change(tmp_path):
    """Registering a task after its partitions filled, or resetting one, recomputes its readiness over the
    rows already there in one Redis call: over --max-readiness-rows that call is refused with
    FAILED_PRECONDITION and changes nothing, so no request can keep Redis busy for long."""
    args = (*hs.CONTROLLER_ARGS, "--max-readiness-rows", "100")
    with LocalTransferQueue(shards=1, log_dir=str(tmp_path), controller_args=args, shard_args=hs.SHARD_ARGS) as stack:
        s = hs.Stubs(stack)
        c = s.controller
        try:
            c.RegisterTask(pb.RegisterTaskRequest(name="r/early", required_fields=["x"]))
            for name in ("r/a", "r/b"):
                c.CreatePartition(pb.CreatePartitionRequest(name=name))
                _put(s, name, np.arange(60))
            details = _rejected(
                s,
                c.RegisterTask,
                pb.RegisterTaskRequest(name="r/late", required_fields=["x"]),
                FP,
                "120 rows in 2 partition(s)",
                "--max-readiness-rows",
            )
            assert "r/late" in details
            # within the bound: registered, and its readiness covers the rows already there
            c.RegisterTask(pb.RegisterTaskRequest(name="other/late", required_fields=["x"]))
            assert c.ResetTask(pb.ResetTaskRequest(partition="r/a", task="r/early")).rows_ready == 60
            c.CreatePartition(pb.CreatePartitionRequest(name="r/big"))
            _put(s, "r/big", np.arange(64))
            _put(s, "r/big", np.arange(64))
            _rejected(
                s,
                c.ResetTask,
                pb.ResetTaskRequest(partition="r/big", task="r/early"),
                FP,
                "128 rows in 1 partition(s)",
                "--max-readiness-rows",
            )
        finally:
            s.close()
