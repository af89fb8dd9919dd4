"""The data plane's semantics (issue #2, items 1-9, 11), against real Redis, controller and shards."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from services.transferqueue.client.shard_client import ShardClient
from services.transferqueue.errors import TQError
from tests.conftest import metric_value, scrape


def _fill(tq, partition, n, group_size=1):
    tq.create_partition(partition, group_size=group_size)
    return tq.put(partition, {"x": torch.arange(n, dtype=torch.int64), "y": torch.arange(n, dtype=torch.float32)})


# 1 ----------------------------------------------------------------------------------------------


def test_row_readable_only_when_all_required_fields_produced(tq, uniq):
    p, task = uniq("p"), uniq("t")
    tq.create_partition(p)
    tq.register_task(task, ["tokens", "log_probs"])
    rows = tq.put(p, {"tokens": [torch.arange(3), torch.arange(5)]})
    assert tq.claim(p, task, 2).rows == []
    tq.put(p, {"log_probs": [torch.ones(5)]}, rows=rows[1:])
    batch = tq.claim(p, task, 2)
    assert batch.rows == [rows[1]]
    assert batch["tokens"][0].tolist() == [0, 1, 2, 3, 4]
    tq.put(p, {"log_probs": [torch.zeros(3)]}, rows=rows[:1])
    assert tq.claim(p, task, 2).rows == [rows[0]]


# 2 ----------------------------------------------------------------------------------------------


def test_claims_exclusive_within_task_and_every_task_sees_every_row(tq_stack, uniq):
    from services.transferqueue.client.queue import TransferQueue

    p = uniq("p")
    tasks = [uniq("t"), uniq("t")]
    with TransferQueue(tq_stack.controller_address) as tq:
        tq.create_partition(p)
        for t in tasks:
            tq.register_task(t, ["x"])
    seen = {t: [] for t in tasks}
    lock = threading.Lock()

    def consume(task):
        with TransferQueue(tq_stack.controller_address) as client:
            while True:
                batch = client.claim(p, task, 7, wait_s=0.5)
                if batch.complete:
                    return
                if batch.rows:
                    assert batch["x"].tolist() == batch.rows
                    with lock:
                        seen[task].extend(batch.rows)
                    client.ack(batch)

    workers = [threading.Thread(target=consume, args=(t,)) for t in tasks for _ in range(2)]
    for w in workers:
        w.start()
    with TransferQueue(tq_stack.controller_address) as tq:
        for start in range(0, 200, 20):
            tq.put(p, {"x": torch.arange(start, start + 20)})
        tq.seal_partition(p)
    for w in workers:
        w.join(60)
    for t in tasks:
        assert sorted(seen[t]) == list(range(200)), t  # once each: no duplicates, nothing missing


# 3 ----------------------------------------------------------------------------------------------


def test_unacked_claim_becomes_readable_after_lease_expiry(tq, uniq):
    p, task = uniq("p"), uniq("t")
    _fill(tq, p, 4)
    tq.register_task(task, ["x"])
    first = tq.claim(p, task, 4, lease_s=2.0)
    assert first.rows == [0, 1, 2, 3]
    assert tq.claim(p, task, 4).rows == []  # held by the lease
    again = tq.claim(p, task, 4, wait_s=10)  # woken by the expiry, not by a put
    assert again.rows == [0, 1, 2, 3]
    with pytest.raises(TQError) as err:
        tq.ack(first)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "expired" in err.value.message
    assert tq.ack(again) == 4
    assert tq.ack(again) == 0  # idempotent
    info = tq.partition(p)
    assert [(t.consumed, t.leased) for t in info.tasks if t.task == task] == [(4, 0)]


def test_release_returns_rows_and_extend_keeps_them(tq, uniq):
    p, task = uniq("p"), uniq("t")
    _fill(tq, p, 2)
    tq.register_task(task, ["x"])
    batch = tq.claim(p, task, 2, lease_s=2.0)
    tq.extend_lease(batch, 30)
    time.sleep(2.5)
    assert tq.claim(p, task, 2).rows == []  # extended: still held
    assert tq.release(batch) == 2
    assert tq.claim(p, task, 2).rows == [0, 1]


# 4 ----------------------------------------------------------------------------------------------


def test_group_claims_return_whole_groups(tq, uniq):
    p, task = uniq("p"), uniq("t")
    tq.create_partition(p, group_size=4)
    tq.register_task(task, ["x", "r"], group_size=4)
    rows = tq.put(p, {"x": torch.arange(12)})
    tq.put(p, {"r": torch.ones(6)}, rows=rows[:6])  # group 0 whole, group 1 half
    batch = tq.claim(p, task, 8, wait_s=0.2)
    assert batch.rows == [0, 1, 2, 3]
    with pytest.raises(TQError) as err:
        tq.claim(p, task, 6)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(TQError) as err:
        tq.put(p, {"x": torch.arange(3)})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(TQError) as err:
        tq.ack(batch, rows=[0, 1])  # acks cover whole groups
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


# 5 ----------------------------------------------------------------------------------------------


def test_claim_waits_without_spinning_and_returns_what_is_ready(tq_stack, tq, uniq):
    p, task = uniq("p"), uniq("t")
    _fill(tq, p, 3)
    tq.register_task(task, ["x"])
    before = metric_value(scrape(tq_stack.metrics_port), "sluice_tq_rpc_total", method="Claim")
    start = time.monotonic()
    batch = tq.claim(p, task, 8, wait_s=0.6)
    waited = time.monotonic() - start
    after = metric_value(scrape(tq_stack.metrics_port), "sluice_tq_rpc_total", method="Claim")
    assert batch.rows == [0, 1, 2]  # what was ready, at the deadline
    assert waited >= 0.55
    assert after - before == 1  # one call: the wait happened in the server


def test_waiting_claim_wakes_on_put_and_does_not_block_others(tq_stack, uniq):
    from services.transferqueue.client.queue import TransferQueue

    p_wait, p_other, task = uniq("p"), uniq("p"), uniq("t")
    with TransferQueue(tq_stack.controller_address) as tq:
        tq.create_partition(p_wait)
        _fill(tq, p_other, 1)
        tq.register_task(task, ["x"])
    result = {}

    def waiter():
        with TransferQueue(tq_stack.controller_address) as client:
            t0 = time.monotonic()
            result["batch"] = client.claim(p_wait, task, 1, wait_s=20)
            result["took"] = time.monotonic() - t0

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    with TransferQueue(tq_stack.controller_address) as tq:
        t0 = time.monotonic()
        assert tq.claim(p_other, task, 1).rows == [0]  # answered while the other claim waits
        assert time.monotonic() - t0 < 10  # the other claim waits up to 20 s
        assert thread.is_alive()
        tq.put(p_wait, {"x": torch.tensor([42])})
    thread.join(10)
    assert result["batch"]["x"].tolist() == [42]  # bytes readable as soon as the row is
    assert result["took"] < 10


# 6 ----------------------------------------------------------------------------------------------


def test_schema_fixed_by_first_write(tq, uniq):
    p = uniq("p")
    tq.create_partition(p)
    tq.put(p, {"ids": torch.zeros(2, 4, dtype=torch.int64)})
    before = tq.partition(p)
    for bad in (
        torch.zeros(2, 4, dtype=torch.int32),
        torch.zeros(2, 5, dtype=torch.int64),
        [torch.zeros(4, dtype=torch.int64)] * 2,
        torch.zeros(2, dtype=torch.int64),
    ):
        with pytest.raises(TQError) as err:
            tq.put(p, {"ids": bad})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "ids" in err.value.message
    after = tq.partition(p)
    assert after.allocated_rows == before.allocated_rows == 2
    assert after.fields[0].produced == 2
    assert [f.dtype for f in tq.schema(p)] == ["int64"]


# 7 ----------------------------------------------------------------------------------------------


def test_put_whose_commit_fails_raises_and_leaves_nothing(tq_stack, tq, uniq):
    from services.transferqueue.client.queue import AsyncTransferQueue

    p, task = uniq("p"), uniq("t")
    tq.create_partition(p)
    tq.register_task(task, ["x"])
    held_before = sum(ShardClient(a).stats().bytes for a in tq_stack.shard_addresses)
    real_commit = tq.core.controller.acommit_put  # the blocking client runs its asyncio core

    async def racing_commit(*args, **kwargs):
        # another writer fixes the field's schema first; our real commit then meets a real conflict
        other = AsyncTransferQueue(tq_stack.controller_address)
        try:
            await other.put(p, {"x": torch.arange(3, dtype=torch.int32)})
        finally:
            await other.close()
        return await real_commit(*args, **kwargs)

    tq.core.controller.acommit_put = racing_commit
    with pytest.raises(TQError) as err:
        tq.put(p, {"x": torch.arange(100, dtype=torch.int64)})
    tq.core.controller.acommit_put = real_commit
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    info = tq.partition(p)
    assert info.rows == 3 and info.allocated_rows == 103  # the failed put's rows never became rows
    batch = tq.claim(p, task, 200)
    assert sorted(batch["x"].tolist()) == [0, 1, 2] and batch["x"].dtype == torch.int32
    held_after = sum(ShardClient(a).stats().bytes for a in tq_stack.shard_addresses)
    assert held_after - held_before == 3 * 4  # the failed put's bytes were deleted again


# 8 ----------------------------------------------------------------------------------------------


def test_unknown_names_are_not_found(tq, uniq):
    p, task = uniq("p"), uniq("t")
    _fill(tq, p, 2)
    tq.register_task(task, ["x"])
    cases = [
        (lambda: tq.claim("nope_" + p, task, 1), "nope_" + p),
        (lambda: tq.claim(p, "nope_" + task, 1), "nope_" + task),
        (lambda: tq.get(p, [0], ["nope_field"]), "nope_field"),
        (lambda: tq.get(p, [0, 7], ["x"]), "row 7"),
        (lambda: tq.put("nope_" + p, {"x": torch.arange(2)}), "nope_" + p),
        (lambda: tq.put(p, {"x": torch.arange(1)}, rows=[9]), "row 9"),
    ]
    for call, named in cases:
        with pytest.raises(TQError) as err:
            call()
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert named in err.value.message


def test_read_of_row_missing_a_field_never_returns_fewer_rows(tq, uniq):
    p = uniq("p")
    tq.create_partition(p)
    rows = tq.put(p, {"x": torch.arange(3)})
    tq.put(p, {"z": torch.arange(2)}, rows=rows[:2])
    assert tq.get(p, rows[:2], ["x", "z"])["z"].tolist() == [0, 1]
    with pytest.raises(TQError) as err:
        tq.get(p, rows, ["x", "z"])
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "row 2" in err.value.message


# 9 ----------------------------------------------------------------------------------------------


def test_clear_is_idempotent_and_frees_memory(tq_stack, tq, uniq):
    p = uniq("p")
    tq.create_partition(p)
    tq.put(p, {"big": torch.zeros(256, 4096)})
    held = sum(ShardClient(a).stats().bytes for a in tq_stack.shard_addresses)
    assert held >= 256 * 4096 * 4
    assert tq.clear_partition(p) is True
    assert tq.clear_partition(p) is False
    assert p not in [i.name for i in tq.list_partitions()]
    for address in tq_stack.shard_addresses:
        assert p not in ShardClient(address).stats().partitions
    assert sum(ShardClient(a).stats().bytes for a in tq_stack.shard_addresses) <= held - 256 * 4096 * 4
    with pytest.raises(TQError) as err:
        tq.partition(p)
    assert err.value.code == grpc.StatusCode.NOT_FOUND


# 11 ---------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


@pytest.mark.parametrize("async_client", [False, True])
def test_round_trips_are_byte_exact(tq_stack, uniq, async_client):
    import asyncio

    from services.transferqueue.client.queue import AsyncTransferQueue, TransferQueue

    g = torch.Generator().manual_seed(0)
    n = 130  # spans both shards (placement blocks of 64 rows)
    raw = torch.randint(0, 2**16, (n, 3), generator=g, dtype=torch.int32).to(torch.int16)
    columns = {
        "i64": torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (n, 2), generator=g, dtype=torch.int32),
        "f32": torch.randn(n, 2, 2, generator=g),
        "f16": raw.view(torch.float16),  # arbitrary bit patterns, NaN payloads included
        "bf16": raw.view(torch.bfloat16),
        "flag": torch.rand(n, 5, generator=g) > 0.5,
        "scalar": torch.randn(n, generator=g, dtype=torch.float64),
        "tokens": [torch.randint(0, 50000, (int(k),), generator=g) for k in torch.randint(0, 40, (n,), generator=g)],
        "text": [f"sample {i} ✓" for i in range(n)],
    }
    p = uniq("p")

    async def via_async():
        async with AsyncTransferQueue(tq_stack.controller_address) as aq:
            await aq.create_partition(p)
            rows = await aq.put(p, columns)
            return await aq.get(p, rows[::-1], list(columns))

    if async_client:
        batch = asyncio.run(via_async())
    else:
        with TransferQueue(tq_stack.controller_address) as tq:
            tq.create_partition(p)
            rows = tq.put(p, columns)
            batch = tq.get(p, rows[::-1], list(columns))
    order = list(range(n))[::-1]
    for name, value in columns.items():
        got = batch[name]
        if name == "text":
            assert got == [value[i] for i in order]
        elif name == "tokens":
            assert all(_bits(got[j]) == _bits(value[i]) and got[j].dtype == value[i].dtype for j, i in enumerate(order))
        else:
            assert isinstance(got, torch.Tensor) and got.dtype == value.dtype and got.shape == value.shape, name
            assert _bits(got) == _bits(value[order]), name


def test_ragged_padded_on_request(tq, uniq):
    p = uniq("p")
    tq.create_partition(p)
    rows = tq.put(p, {"tokens": [torch.tensor([1, 2, 3]), torch.tensor([4])]})
    batch = tq.get(p, rows, ["tokens"], padded=True, pad_value=-1)
    assert batch["tokens"].tolist() == [[1, 2, 3], [4, -1, -1]]
    assert batch.lengths["tokens"].tolist() == [3, 1]


# 12 ---------------------------------------------------------------------------------------------


def test_malformed_input_is_invalid_argument(tq_stack, tq, uniq):
    import pyarrow as pa

    from services.transferqueue.pb import transferqueue_pb2 as pb

    p = uniq("p")
    tq.create_partition(p)
    shard = ShardClient(tq_stack.shard_addresses[0])
    # a genuine reservation, so the shard gets as far as the bytes
    from services.transferqueue.client.controller_client import ControllerClient

    reservation = (
        ControllerClient(tq_stack.controller_address)
        .prepare_put(p, [pb.FieldSchema(name="x", dtype="int64", kind=pb.SCALAR)], new_rows=1)
        .reservation
    )
    with pytest.raises(TQError) as err:
        shard.put(p, [0], b"\x00not arrow at all" * 10, reservation=reservation)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # valid Arrow, but a type no Sluice column has
    table = pa.table({"x": pa.array([{"a": 1}])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(TQError) as err:
        shard.put(p, [0], sink.getvalue(), reservation=reservation)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # undecodable protobuf, to both servers
    for address, method in (
        (tq_stack.controller_address, "/sluice.transferqueue.v1.Controller/Claim"),
        (tq_stack.shard_addresses[0], "/sluice.transferqueue.v1.StorageShard/Stats"),
    ):
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as rpc_err:
                call(b"\xff\xff\xff\xff", timeout=5)
            assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # bad names never reach Redis keys
    with pytest.raises(TQError) as err:
        tq.create_partition("bad:name")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert shard.stats().shard_id  # still serving
    assert pb.StatsRequest  # the wire types are protobuf/Arrow only


def test_nothing_in_services_pickles():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "services"
    offenders = [
        str(f) for f in root.rglob("*.py") if "import pickle" in f.read_text() or "cloudpickle" in f.read_text()
    ]
    assert offenders == []


# controller operations beyond the numbered items -----------------------------------------------


def test_reset_task_makes_every_row_readable_again(tq, uniq):
    p, task, other = uniq("p"), uniq("t"), uniq("t")
    _fill(tq, p, 6)
    tq.register_task(task, ["x"])
    tq.register_task(other, ["x"])
    tq.ack(tq.claim(p, task, 4))
    live = tq.claim(p, task, 2)
    tq.ack(tq.claim(p, other, 3))
    assert tq.reset_task(p, task) == 6
    assert tq.claim(p, task, 10).rows == list(range(6))
    with pytest.raises(TQError) as err:
        tq.ack(live)  # the reset voided it
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert [t.consumed for t in tq.partition(p).tasks if t.task == other] == [3]  # other task untouched


def test_wait_ready_and_late_task_registration(tq, uniq):
    p, task = uniq("p"), uniq("t")
    _fill(tq, p, 5)
    tq.register_task(task, ["x", "y"])  # registered after the rows exist
    res = tq.wait_ready(p, task, 5, wait_s=1)
    assert res.ready_rows == 5 and not res.partition_complete
    t0 = time.monotonic()
    assert tq.wait_ready(p, task, 6, wait_s=0.3).ready_rows == 5
    assert time.monotonic() - t0 >= 0.25
    tq.seal_partition(p)
    tq.ack(tq.claim(p, task, 5))
    assert tq.wait_ready(p, task, 6, wait_s=5).partition_complete


def test_sealed_partition_takes_no_new_rows_and_claims_do_not_wait_for_a_full_batch(tq, uniq):
    p, task = uniq("p"), uniq("t")
    _fill(tq, p, 3)
    tq.register_task(task, ["x"])
    tq.seal_partition(p)
    with pytest.raises(TQError) as err:
        tq.put(p, {"x": torch.arange(2), "y": torch.ones(2)})
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    t0 = time.monotonic()
    batch = tq.claim(p, task, 8, wait_s=5)  # nothing more can come: answers at once
    assert batch.rows == [0, 1, 2] and time.monotonic() - t0 < 4  # not the 5 s wait
    tq.ack(batch)
    assert tq.claim(p, task, 8, wait_s=5).complete


def test_async_client_claims_and_acks(tq_stack, uniq):
    import asyncio

    from services.transferqueue.client.queue import AsyncTransferQueue

    p, task = uniq("p"), uniq("t")

    async def scenario():
        async with AsyncTransferQueue(tq_stack.controller_address) as aq:
            await aq.create_partition(p, group_size=2)
            await aq.register_task(task, ["x"], group_size=2)
            waiter = asyncio.create_task(aq.claim(p, task, 4, wait_s=10))
            await asyncio.sleep(0.2)
            await aq.put(p, {"x": torch.arange(4)})
            batch = await waiter
            assert batch["x"].tolist() == [0, 1, 2, 3]
            assert await aq.ack(batch, rows=[2, 3]) == 2
            assert await aq.release(batch) == 2
            again = await aq.claim(p, task, 4)
            assert again.rows == [0, 1]
            await aq.extend_lease(again, 10)
            assert await aq.ack(again) == 2
            await aq.seal_partition(p)
            assert (await aq.claim(p, task, 2)).complete
            assert await aq.clear_partition(p)

    asyncio.run(scenario())


def test_byte_budget_pushes_back(tmp_path):
    from services.transferqueue.client.queue import TransferQueue
    from services.transferqueue.local_stack import LocalTransferQueue

    with LocalTransferQueue(shards=1, log_dir=str(tmp_path), shard_args=("--max-bytes", str(1 << 20))) as stack:
        with TransferQueue(stack.controller_address, put_timeout_s=0.3) as tq:
            tq.create_partition("p")
            tq.put("p", {"x": torch.zeros(100, 1024)})  # 400 KiB
            with pytest.raises(TQError) as err:
                tq.put("p", {"x": torch.zeros(200, 1024)})  # 800 KiB more: over 1 MiB
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "shard full" in err.value.message
            assert tq.partition("p").rows == 100


def test_produced_fields_are_immutable_and_partial_re_ack_is_a_no_op(tq, uniq):
    p, task = uniq("p"), uniq("t")
    rows = _fill(tq, p, 4)
    with pytest.raises(TQError) as err:
        tq.put(p, {"x": torch.arange(2)}, rows=rows[:2])
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and "field x of row 0" in err.value.message
    assert tq.get(p, rows, ["x"])["x"].tolist() == [0, 1, 2, 3]  # the committed bytes are untouched
    tq.register_task(task, ["x"])
    batch = tq.claim(p, task, 4)
    assert tq.ack(batch, rows=[0, 1]) == 2
    assert tq.ack(batch, rows=[0, 1]) == 0
    assert tq.ack(batch) == 2


def test_claim_key_gives_every_caller_the_same_lease_even_after_ack(tq, uniq):
    p, task = uniq("p"), uniq("t")
    _fill(tq, p, 6)
    tq.register_task(task, ["x"])
    first = tq.claim_rows(p, task, 4, claim_key="run-7")
    second = tq.claim_rows(p, task, 4, claim_key="run-7")
    assert (first.lease_id, first.rows) == (second.lease_id, second.rows)
    tq.ack(first.lease_id)
    late = tq.claim_rows(p, task, 4, claim_key="run-7")  # a rank that arrives after the others acked
    assert (late.lease_id, late.rows) == (first.lease_id, first.rows)
    assert tq.claim_rows(p, task, 4, claim_key="run-8").rows == [4, 5]


def test_a_released_claim_key_lease_is_claimed_anew_not_handed_back(tq, uniq):
    # the trainer claims a whole batch under a key; answered short at the deadline, it gives the rows back and
    # claims again: it must get the batch once the rest is ready, not its released short lease forever
    p, task = uniq("p"), uniq("t")
    tq.create_partition(p, group_size=2)
    tq.register_task(task, ["x"], group_size=2)
    tq.put(p, {"x": torch.arange(2)})
    short = tq.claim_rows(p, task, 4, wait_s=0.2, min_rows=4, claim_key="step-5")
    assert short.rows == [0, 1]  # the deadline's answer: what is ready
    tq.release(short.lease_id)
    tq.put(p, {"x": torch.arange(2)})
    whole = tq.claim_rows(p, task, 4, wait_s=5, min_rows=4, claim_key="step-5")
    assert whole.lease_id != short.lease_id and sorted(whole.rows) == [0, 1, 2, 3]
    late = tq.claim_rows(p, task, 4, claim_key="step-5")  # the key now names the new lease
    assert (late.lease_id, late.rows) == (whole.lease_id, whole.rows)
    tq.reset_task(p, task)  # the task starts over: the key's holder claims anew as well
    again = tq.claim_rows(p, task, 4, wait_s=5, min_rows=4, claim_key="step-5")
    assert again.lease_id not in (whole.lease_id, short.lease_id) and sorted(again.rows) == [0, 1, 2, 3]


def test_put_larger_than_the_whole_shard_fails_fast(tmp_path):
    from services.transferqueue.client.queue import TransferQueue
    from services.transferqueue.local_stack import LocalTransferQueue

    with LocalTransferQueue(shards=1, log_dir=str(tmp_path), shard_args=("--max-rows", "4")) as stack:
        with TransferQueue(stack.controller_address, put_timeout_s=30) as tq:
            tq.create_partition("p")
            t0 = time.monotonic()
            with pytest.raises(TQError) as err:
                tq.put("p", {"x": torch.arange(5)})
            assert err.value.code == grpc.StatusCode.OUT_OF_RANGE and "split it" in err.value.message
            assert time.monotonic() - t0 < 5  # not retried until put_timeout_s
