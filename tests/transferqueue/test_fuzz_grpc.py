"""Property-based fuzzing of every gRPC method of the controller and the storage shard (issue #13).

Requests are built from the .proto descriptors with random fields: names valid and not, extreme
integers, unknown enum values, lists over the per-call caps, reservations genuine, truncated and forged,
and Arrow IPC that is valid, truncated, bit-flipped, compressed, null-carrying or lying about its
offsets. Every call must end in a deliberate status (never INTERNAL, UNKNOWN, or a hang) and, when it is
refused, leave all state as it was (every Redis key and the shard's stats); both servers must be healthy
and working afterwards."""

from __future__ import annotations

import collections
import secrets

import grpc
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.local_stack import grpc_serving
from services.transferqueue.pb import transferqueue_pb2 as pb
from tests.redis_state import changed_keys
from tests.transferqueue import hardened_stack as hs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FORBIDDEN = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
}
EXAMPLES_PER_METHOD = 50
CODES: collections.Counter = collections.Counter()

# valid names of what exists twice as often as anything else, so calls get past the name checks
_VALID = st.sampled_from(["fz", "fzt", "x", "y", "run/fz"])
NAMES = st.one_of(
    _VALID,
    _VALID,
    st.sampled_from(["", "a" * 129, "bad:name", "../x", "é", "a/b/c"]),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
)
INTS = st.sampled_from([0, 1, -1, 2, 63, 64, 65, 255, 256, 2**31, 2**53 + 1, 2**62, -(2**63), 2**63 - 1]) | st.integers(
    -5, 300
)
ROW_LISTS = (
    st.lists(INTS, max_size=6) | st.just(list(range(hs.ROWS_PER_CALL + 1))) | st.just([3, 3]) | st.just([-1, -2])
)


def _arrow_payloads() -> list[bytes]:
    good = hs.ipc(("x", pa.array(np.arange(4), type=pa.int64()), "int64"))
    tensor = pa.ExtensionArray.from_storage(
        pa.fixed_shape_tensor(pa.int8(), [2]), pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8), pa.int8()), 2)
    )
    return [
        good,
        good[: len(good) // 2],
        b"",
        b"\xff" * 64,
        hs.lying_offsets([0, 2, 1 << 20]),
        hs.lying_offsets([0, 3, 1]),
        hs.ipc(("x", pa.array([1, None, 3, 4], type=pa.int64()), "int64")),
        hs.ipc(("x", pa.array(np.arange(4)), "int64"), compression="zstd"),
        hs.ipc(("x", tensor, "int8")),
        hs.ipc(("x", pa.array(["a", "b", "c", "d"], type=pa.large_string()), "string")),
    ]


def _flip(data: bytes, index: int, value: int) -> bytes:
    if not data:
        return data
    i = index % len(data)
    return data[:i] + bytes([value]) + data[i + 1 :]


PAYLOADS = st.builds(
    _flip, st.sampled_from(_arrow_payloads()), st.integers(0, 1 << 20), st.integers(0, 255)
) | st.sampled_from(_arrow_payloads())


def _value(field, depth: int, extra: dict):
    if field.full_name in extra:
        return extra[field.full_name]
    t = field.type
    if t == field.TYPE_MESSAGE:
        if depth >= 2:
            return st.none()
        one = _message(field.message_type, depth + 1, extra)
        return st.lists(one, max_size=3) if field.is_repeated else one
    if t == field.TYPE_ENUM:
        one = st.sampled_from([0, 1, 2, 3, 4, 99, -1])
    elif t == field.TYPE_STRING:
        one = NAMES
    elif t == field.TYPE_BYTES:
        one = st.binary(max_size=64)
    elif t == field.TYPE_BOOL:
        one = st.booleans()
    else:
        one = INTS
    if field.is_repeated:
        return ROW_LISTS if t == field.TYPE_INT64 else st.lists(one, max_size=4)
    return one


def _message(desc, depth: int = 0, extra: dict | None = None):
    extra = extra or {}
    cls = getattr(pb, desc.name)
    fields = {f.name: _value(f, depth, extra) for f in desc.fields}
    return st.fixed_dictionaries({}, optional=fields).map(
        lambda d: cls(**{k: v for k, v in d.items() if v is not None})
    )


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    stack = hs.start(str(tmp_path_factory.mktemp("tq-fuzz")))
    stubs = hs.Stubs(stack)
    c = stubs.controller
    # a name no example can guess: Hypothesis also draws the string constants of this module
    stubs.kept = f"kept-{secrets.token_hex(8)}"
    for name in ("fz", stubs.kept):
        c.CreatePartition(pb.CreatePartitionRequest(name=name))
    c.RegisterTask(pb.RegisterTaskRequest(name="fzt", required_fields=["x"]))
    prepared = c.PreparePut(pb.PreparePutRequest(partition="fz", fields=[hs.scalar("x")], new_rows=4))
    genuine = prepared.reservation
    stubs.reservations = [b"", genuine, genuine[:-1] + b"\0", genuine[:20]]
    yield stubs
    stubs.close()
    stack.stop()
    print(f"\nfuzzed gRPC status codes: {dict(CODES)}")


def _methods(service: str):
    return [(service, m) for m in pb.DESCRIPTOR.services_by_name[service].methods]


def _check(stubs: hs.Stubs, call, request, streaming_response: bool) -> None:
    before = stubs.snapshot()
    try:
        result = call(request, timeout=10)
        if streaming_response:
            list(result)
        CODES["OK"] += 1
    except grpc.RpcError as err:
        CODES[err.code().name] += 1
        assert err.code() not in FORBIDDEN, f"{err.code()}: {err.details()}"
        assert err.details(), "a rejected call must say what was wrong"
        after = stubs.snapshot()
        changed = changed_keys(before[0], after[0]) + (["shard stats"] if before[1] != after[1] else [])
        assert not changed, f"{err.code()} ({err.details()}), yet it changed {changed}"


@pytest.mark.parametrize(
    "service,method",
    _methods("Controller") + _methods("StorageShard"),
    ids=lambda v: v if isinstance(v, str) else v.name,
)
def test_every_method_survives_random_input(fuzzed, service, method):
    stub = fuzzed.controller if service == "Controller" else fuzzed.shard
    call = getattr(stub, method.name)
    if method.client_streaming:  # Put: a header (maybe genuine) and Arrow bytes (maybe malformed)
        header = _message(
            pb.PutHeader.DESCRIPTOR,
            extra={
                "sluice.transferqueue.v1.PutHeader.reservation": st.sampled_from(fuzzed.reservations),
                "sluice.transferqueue.v1.PutHeader.total_bytes": INTS | st.just(-1),
            },
        )
        requests = st.tuples(header, PAYLOADS, st.booleans()).map(
            lambda t: (
                [pb.PutChunk(header=t[0], data=t[1])]
                if t[2]
                else [
                    pb.PutChunk(
                        header=pb.PutHeader(
                            partition="fz", rows=[0, 1, 2, 3], total_bytes=len(t[1]), reservation=fuzzed.reservations[1]
                        ),
                        data=t[1],
                    )
                ]
            )
        )
    else:
        requests = _message(method.input_type)

    @settings(
        max_examples=EXAMPLES_PER_METHOD,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(request=requests)
    def run(request):
        _check(fuzzed, call, iter(request) if method.client_streaming else request, method.server_streaming)

    run()
    assert grpc_serving(fuzzed.stack.controller_address) and grpc_serving(fuzzed.stack.shard_addresses[0])


def test_servers_still_work_after_fuzzing(fuzzed):
    """Runs after the fuzzing (same module): a put and a claim on a partition made before it."""
    with TransferQueue(fuzzed.stack.controller_address, put_timeout_s=10) as tq:
        task = f"{fuzzed.kept}-t"
        tq.register_task(task, ["v"])
        rows = tq.put(fuzzed.kept, {"v": torch.arange(4)})
        batch = tq.claim(fuzzed.kept, task, 4)
        assert batch.rows == rows and batch["v"].tolist() == [0, 1, 2, 3]
        assert tq.ack(batch) == 4
