"""ShardClient: the only code that knows the storage shard's wire API (chunked Arrow IPC streams)."""

from __future__ import annotations

import grpc

from services.transferqueue.client.channel import GrpcTransport
from services.transferqueue.client.rpc_pair import rpc_pair
from services.transferqueue.data_chunks import data_only, encode_chunk
from services.transferqueue.errors import TQError
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.transferqueue.pb import transferqueue_pb2_grpc as pb_grpc

CHUNK_BYTES = 4 << 20


_PUT = "/sluice.transferqueue.v1.StorageShard/Put"
_GET = "/sluice.transferqueue.v1.StorageShard/Get"


def _put_chunks(partition: str, rows, data, chunk_bytes: int, reservation: bytes):
    """Serialized PutChunk messages: the header with the first chunk, then data-only chunks."""
    view = memoryview(data)
    total = len(view)
    header = pb.PutHeader(partition=partition, rows=rows, total_bytes=total, reservation=reservation)
    head = pb.PutChunk(header=header).SerializeToString()
    yield encode_chunk(view[:chunk_bytes], head)
    for start in range(chunk_bytes, total, chunk_bytes):
        yield encode_chunk(view[start : start + chunk_bytes])


class _Assembler:
    """Collects a chunked IPC stream into one writable buffer (tensors decoded from it share it)."""

    def __init__(self):
        self.buf: bytearray | None = None
        self.pos = 0

    def add(self, raw: bytes) -> None:
        data = data_only(raw) if self.buf is not None else None
        if data is None:
            chunk = pb.DataChunk.FromString(raw)
            data = chunk.data
            if self.buf is None:
                self.buf = bytearray(chunk.total_bytes)
        assert self.buf is not None  # made for the first chunk, the only one read without it
        end = self.pos + len(data)
        if end > len(self.buf):
            raise TQError(grpc.StatusCode.DATA_LOSS, "shard sent more bytes than it announced")
        self.buf[self.pos : end] = data
        self.pos = end

    def result(self) -> bytearray:
        if self.buf is None or self.pos != len(self.buf):
            raise TQError(grpc.StatusCode.DATA_LOSS, "shard stream ended early")
        return self.buf


class ShardClient(GrpcTransport):
    stub_class = pb_grpc.StorageShardStub
    default_timeout_s = 120.0

    def __init__(self, address: str, token: str | None = None, chunk_bytes: int = CHUNK_BYTES):
        super().__init__(address, token)
        self.chunk_bytes = chunk_bytes

    # ------------------------------------------------------------ data

    def put(
        self, partition: str, rows, ipc_data, timeout: float | None = None, reservation: bytes = b""
    ) -> pb.PutResponse:
        """`reservation`: PreparePutResponse.reservation for these rows (shards refuse puts without one)."""
        try:
            put = self._raw_call(False, "stream_unary", _PUT, None, pb.PutResponse.FromString)
            return put(
                _put_chunks(partition, rows, ipc_data, self.chunk_bytes, reservation),
                timeout=timeout or self.default_timeout_s,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as err:
            raise TQError.from_rpc(err) from None

    async def aput(
        self,
        partition: str,
        rows,
        ipc_data,
        timeout: float | None = None,
        reservation: bytes = b"",
        wait_for_ready: bool = True,
    ) -> pb.PutResponse:
        """`wait_for_ready=False`: UNAVAILABLE at once while the shard cannot be reached."""
        try:
            put = self._raw_call(True, "stream_unary", _PUT, None, pb.PutResponse.FromString)
            return await put(
                _put_chunks(partition, rows, ipc_data, self.chunk_bytes, reservation),
                timeout=timeout or self.default_timeout_s,
                metadata=self._metadata,
                wait_for_ready=wait_for_ready,
            )
        except grpc.RpcError as err:
            raise TQError.from_rpc(err) from None

    def get(self, partition: str, rows, fields, timeout: float | None = None) -> bytearray:
        """The Arrow IPC stream of the rows (in request order) and fields."""
        request = pb.GetRequest(partition=partition, rows=rows, fields=fields)
        out = _Assembler()
        try:
            get = self._raw_call(False, "unary_stream", _GET, pb.GetRequest.SerializeToString, None)
            for chunk in get(
                request, timeout=timeout or self.default_timeout_s, metadata=self._metadata, wait_for_ready=True
            ):
                out.add(chunk)
        except grpc.RpcError as err:
            raise TQError.from_rpc(err) from None
        return out.result()

    async def aget(
        self, partition: str, rows, fields, timeout: float | None = None, wait_for_ready: bool = True
    ) -> bytearray:
        """`wait_for_ready=False`: UNAVAILABLE at once while the shard cannot be reached."""
        request = pb.GetRequest(partition=partition, rows=rows, fields=fields)
        out = _Assembler()
        try:
            get = self._raw_call(True, "unary_stream", _GET, pb.GetRequest.SerializeToString, None)
            async for chunk in get(
                request,
                timeout=timeout or self.default_timeout_s,
                metadata=self._metadata,
                wait_for_ready=wait_for_ready,
            ):
                out.add(chunk)
        except grpc.RpcError as err:
            raise TQError.from_rpc(err) from None
        return out.result()

    # ------------------------------------------------------------ housekeeping

    def _delete(self, partition: str, rows, fields):
        return "Delete", pb.DeleteRequest(partition=partition, rows=rows, fields=fields)

    def _drop_partition(self, partition: str):
        return "DropPartition", pb.DropPartitionRequest(partition=partition)

    def _stats(self):
        return "Stats", pb.StatsRequest()

    delete, adelete = rpc_pair(_delete)
    drop_partition, adrop_partition = rpc_pair(_drop_partition)
    stats, astats = rpc_pair(_stats)
