"""A TransferQueue with small input caps, raw stubs to call it with, and a snapshot of all its state
(every Redis key's contents, every shard's stats) so tests can assert that a rejected call changed nothing."""

from __future__ import annotations

import grpc
import numpy as np
import pyarrow as pa
import redis

from services.transferqueue.local_stack import LocalTransferQueue
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.transferqueue.pb import transferqueue_pb2_grpc as pb_grpc
from tests.redis_state import redis_digest

ROWS_PER_CALL = 64
PARTITION_ROWS = 256
MAX_LEASE_MS = 10_000
PUT_BYTES = 64 << 10
RESPONSE_BYTES = 32 << 10
CONTROLLER_MESSAGE_BYTES = 1 << 20

CONTROLLER_ARGS = (
    "--max-rows-per-call",
    str(ROWS_PER_CALL),
    "--max-partition-rows",
    str(PARTITION_ROWS),
    "--max-lease-ms",
    str(MAX_LEASE_MS),
    "--default-lease-ms",
    "5000",
    "--max-partitions",
    "50",
    "--max-tasks",
    "50",
    "--max-wait-ms",
    "100",
    "--max-message-bytes",
    str(CONTROLLER_MESSAGE_BYTES),
    "--max-shard-ttl-ms",
    "60000",
)
SHARD_ARGS = (
    "--max-rows-per-call",
    str(ROWS_PER_CALL),
    "--max-partition-rows",
    str(PARTITION_ROWS),
    "--max-put-bytes",
    str(PUT_BYTES),
    "--max-response-bytes",
    str(RESPONSE_BYTES),
)

# the shards renew their registration every few seconds: those keys change on their own
_LIVE_KEYS = {b"tq:shard_ttl", b"tq:shards"}


def start(log_dir: str) -> LocalTransferQueue:
    return LocalTransferQueue(shards=1, log_dir=log_dir, controller_args=CONTROLLER_ARGS, shard_args=SHARD_ARGS)


class Stubs:
    def __init__(self, stack: LocalTransferQueue):
        self.stack = stack
        self._channels = [
            grpc.insecure_channel(stack.controller_address),
            grpc.insecure_channel(stack.shard_addresses[0]),
        ]
        self.controller = pb_grpc.ControllerStub(self._channels[0])
        self.shard = pb_grpc.StorageShardStub(self._channels[1])
        self.redis = redis.Redis.from_url(stack.redis_url)

    def snapshot(self) -> tuple:
        dumped = tuple(k for k in redis_digest(self.redis) if k[0] not in _LIVE_KEYS)
        stats = self.shard.Stats(pb.StatsRequest(), timeout=10)
        return dumped, (stats.rows, stats.bytes, tuple(stats.partitions))

    def raw_controller(self, method: str):
        """The controller's `method` taking and returning bytes (to send what no stub would)."""
        return self._channels[0].unary_unary(
            f"/sluice.transferqueue.v1.Controller/{method}", request_serializer=None, response_deserializer=None
        )

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self.redis.close()


def scalar(name: str, dtype: str = "int64") -> pb.FieldSchema:
    return pb.FieldSchema(name=name, dtype=dtype, kind=pb.SCALAR)


def ipc(*arrays: tuple[str, pa.Array, str], compression: str | None = None) -> bytes:
    """An Arrow IPC stream of (name, array, sluice dtype) columns."""
    fields = [pa.field(n, a.type, metadata={b"sluice.dtype": d.encode()}) for n, a, d in arrays]
    batch = pa.RecordBatch.from_arrays([a for _, a, _ in arrays], schema=pa.schema(fields))
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write(batch)
    return sink.getvalue().to_pybytes()


def put_chunks(partition: str, rows, data: bytes, reservation: bytes = b"", total: int | None = None):
    header = pb.PutHeader(
        partition=partition, rows=rows, total_bytes=len(data) if total is None else total, reservation=reservation
    )
    return iter([pb.PutChunk(header=header, data=data)])


def lying_offsets(lie: list[int]) -> bytes:
    """A valid ragged column's IPC stream with its offsets buffer overwritten by `lie` (Arrow itself
    refuses to build such an array, so the bytes are patched)."""
    honest = np.array([0, 2, 3], dtype=np.int64).tobytes()
    data = ipc(("x", pa.array([[1, 2], [3]], type=pa.large_list(pa.int64())), "int64"))
    assert data.count(honest) == 1
    return data.replace(honest, np.array(lie, dtype=np.int64).tobytes())
