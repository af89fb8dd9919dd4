"""The storage shard: gRPC over ShardStore. Registers itself with the controller and keeps the
registration alive; drops partitions the controller no longer knows (a missed clear)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from services.runtime.grpc_auth import BearerTokenInterceptor
from services.runtime.grpc_strict import add_strict_servicer
from services.runtime.grpc_tls import add_port
from services.transferqueue.client.controller_client import ControllerClient
from services.transferqueue import reservation
from services.transferqueue.bounds import Limits, check_field_names, check_rows, invalid
from services.transferqueue.data_chunks import data_only, encode_chunk
from services.transferqueue.wire_format import from_untrusted_ipc, to_ipc
from services.transferqueue.errors import TQError, check_name
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.transferqueue.pb import transferqueue_pb2_grpc as pb_grpc
from services.transferqueue.rpc import rpc_scope, unary_handler
from services.transferqueue.shard.config import ShardConfig
from services.transferqueue.shard.journal import ShardJournal
from services.transferqueue.shard.store import ShardStore

log = logging.getLogger(__name__)

SERVER = "shard"
BYTES_IN = Counter("sluice_tq_shard_bytes_in_total", "Arrow bytes received by puts")
BYTES_OUT = Counter("sluice_tq_shard_bytes_out_total", "Arrow bytes sent by gets")
STORED_BYTES = Gauge("sluice_tq_shard_stored_bytes", "bytes held")
STORED_ROWS = Gauge("sluice_tq_shard_stored_rows", "rows held")


def _exhausted(message: str) -> TQError:
    return TQError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class ShardServicer(pb_grpc.StorageShardServicer):
    def __init__(self, config: ShardConfig, store: ShardStore, shard_id: str, incarnation: str = ""):
        self.config = config
        self.store = store
        self.shard_id = shard_id
        self.incarnation = incarnation  # of the data it holds (RegisterShardRequest.incarnation)
        self.limits = Limits(
            max_rows_per_call=config.max_rows_per_call,
            max_partition_rows=config.max_partition_rows,
            max_fields_per_call=config.max_fields_per_call,
            max_row_elements=config.max_row_elements,
        )
        # put reservations are checked with these (the controller's current key, and the one before it)
        self.reservation_keys: list[bytes] = []

    def learn_reservation_key(self, key: bytes) -> None:
        if key and (not self.reservation_keys or self.reservation_keys[0] != key):
            self.reservation_keys = [key, *self.reservation_keys[:1]]

    def _rows(self, name: str, values, allow_repeats: bool = False) -> np.ndarray:
        """Row indices, bounded before numpy ever sees them (a negative index would address other rows)."""
        if len(values) == 0:
            raise invalid(f"{name}: no rows given")
        rows = check_rows(name, values, self.limits, allow_repeats=allow_repeats)
        return np.asarray(rows, dtype=np.int64)

    def _header(self, chunk) -> pb.PutHeader:
        """Check a put's header before any of its bytes are kept: name, rows, size, reservation."""
        if not chunk.HasField("header"):
            raise invalid("first put message must carry the header")
        header = chunk.header
        check_name("partition", header.partition)
        rows = self._rows("header.rows", header.rows)
        if header.total_bytes <= 0:
            raise invalid(f"header.total_bytes must be positive, got {header.total_bytes}")
        if header.total_bytes > self.config.max_put_bytes:
            raise _exhausted(
                f"put announces {header.total_bytes} bytes; one put may send at most "
                f"{self.config.max_put_bytes} (--max-put-bytes): split it"
            )
        if header.total_bytes > self.store.max_bytes:
            raise TQError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"put announces {header.total_bytes} bytes; budget is {self.store.max_bytes}",
            )
        reservation.verify(
            self.reservation_keys, header.partition, int(rows.min()), int(rows.max()), header.reservation
        )
        return header

    def _gauges(self) -> None:
        STORED_BYTES.set(self.store.bytes)
        STORED_ROWS.set(self.store.rows)

    async def Put(self, request_iterator, context):
        async with rpc_scope(SERVER, "Put", context):
            buf, header = bytearray(), None  # buf: sized by the header, the first message
            pos = 0
            async for raw in request_iterator:  # raw PutChunk bytes (see data_chunks)
                data = data_only(raw) if header is not None else None
                if data is None:
                    try:
                        chunk = pb.PutChunk.FromString(raw)
                    except DecodeError as exc:
                        raise TQError(
                            grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid PutChunk: {exc}"
                        ) from None
                    data = chunk.data
                if header is None:
                    header = self._header(chunk)
                    buf = bytearray(header.total_bytes)
                if pos + len(data) > len(buf):
                    raise _exhausted(f"put sends more than the {len(buf)} bytes its header announced")
                buf[pos : pos + len(data)] = data
                pos += len(data)
            if header is None or pos != len(buf):
                raise TQError(grpc.StatusCode.INVALID_ARGUMENT, f"put ended after {pos} of its announced bytes")
            table = from_untrusted_ipc(buf, self.config.max_row_elements)
            nbytes = self.store.put(header.partition, np.asarray(header.rows, dtype=np.int64), table, ipc=buf)
            BYTES_IN.inc(pos)
            self._gauges()
            return pb.PutResponse(rows=len(header.rows), bytes=nbytes, incarnation=self.incarnation)

    async def Get(self, request, context):
        """Yields serialized DataChunk messages (see data_chunks)."""
        async with rpc_scope(SERVER, "Get", context):
            check_name("partition", request.partition)
            if not request.fields:
                raise invalid("name the fields to read")
            fields = check_field_names("fields", request.fields, self.limits)
            table = self.store.get(request.partition, self._rows("rows", request.rows, allow_repeats=True), fields)
            if table.nbytes > self.config.max_response_bytes:
                raise _exhausted(
                    f"get of {table.num_rows} rows is {table.nbytes} bytes; one get may return at most "
                    f"{self.config.max_response_bytes} (--max-response-bytes): read fewer rows"
                )
            data = to_ipc(table)
            view = memoryview(data)
            step = self.config.chunk_bytes
            total = len(view)
            BYTES_OUT.inc(total)
            yield encode_chunk(view[:step], pb.DataChunk(total_bytes=total).SerializeToString())
            for offset in range(step, total, step):
                yield encode_chunk(view[offset : offset + step])

    @unary_handler(SERVER)
    async def Delete(self, request, context):
        check_name("partition", request.partition)
        fields = check_field_names("fields", request.fields, self.limits)
        cells = self.store.delete(request.partition, self._rows("rows", request.rows), fields)
        self._gauges()
        return pb.DeleteResponse(cells=cells)

    @unary_handler(SERVER)
    async def DropPartition(self, request, context):
        existed, freed = self.store.drop(check_name("partition", request.partition))
        self._gauges()
        return pb.DropPartitionResponse(existed=existed, bytes_freed=freed)

    @unary_handler(SERVER)
    async def Stats(self, request, context):
        return pb.StatsResponse(
            shard_id=self.shard_id,
            rows=self.store.rows,
            bytes=self.store.bytes,
            max_rows=self.store.max_rows,
            max_bytes=self.store.max_bytes,
            partitions=self.store.partition_names(),
        )


async def _keep_registered(
    config: ShardConfig, servicer: ShardServicer, address: str, incarnation: str, registered: asyncio.Event
) -> None:
    store, shard_id = servicer.store, servicer.shard_id
    controller = ControllerClient(config.controller, token=config.auth_token or None)
    ttl_ms = int(config.register_interval_s * 4000)
    try:
        while True:
            asked = time.time()
            try:
                reply = await controller.aregister_shard(shard_id, address, ttl_ms, incarnation, timeout=5)
                servicer.learn_reservation_key(reply.reservation_key)
                live = set(reply.live_partitions)
                if not registered.is_set():
                    log.info(
                        "registered with controller", extra={"controller": config.controller, "shard_id": shard_id}
                    )
                registered.set()
                for name in store.partition_names():
                    created = store.created(name)
                    if name not in live and created is not None and created < asked - config.orphan_grace_s:
                        store.drop(name)
                        log.info("dropped partition the controller no longer knows", extra={"partition": name})
            except TQError as exc:
                log.warning("registration failed; retrying", extra={"error": exc.message, "code": exc.code.name})
            await asyncio.sleep(config.register_interval_s if registered.is_set() else 0.2)
    finally:
        await controller.aclose()


def open_store(config: ShardConfig) -> tuple[ShardStore, str]:
    """The store, with what its journal holds when --data-dir is set (a restart after a kill), and the
    incarnation of its data (a new one per start without a journal)."""
    if not config.data_dir:
        return ShardStore(config.max_rows, config.max_bytes), uuid.uuid4().hex
    journal = ShardJournal(config.data_dir, fsync=config.journal_fsync, compact_bytes=config.journal_compact_bytes)
    store = ShardStore(config.max_rows, config.max_bytes, journal)
    started = time.monotonic()
    records, report = journal.replay()
    store.replay(records, config.max_row_elements)
    log.info(
        "journal replayed",
        extra={
            "data_dir": config.data_dir,
            "records": report.records,
            "journal_bytes": report.bytes,
            "torn_bytes": report.torn_bytes,
            "rows": store.rows,
            "bytes": store.bytes,
            "seconds": round(time.monotonic() - started, 3),
        },
    )
    return store, journal.incarnation()


async def serve(config: ShardConfig, stop: asyncio.Event) -> None:
    store, incarnation = open_store(config)
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    port = add_port(server, f"{config.host}:{config.port}", config)
    servicer = ShardServicer(config, store, config.resolved_id(port), incarnation)
    shard_id = servicer.shard_id
    add_strict_servicer(
        server,
        servicer,
        pb.DESCRIPTOR.services_by_name["StorageShard"],
        raw_requests=frozenset({"Put"}),
        raw_responses=frozenset({"Get"}),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # the health servicer says SERVING for "" by default: not until the controller knows us
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    registered = asyncio.Event()
    address = config.resolved_address(port)
    keeper = asyncio.create_task(_keep_registered(config, servicer, address, incarnation, registered))
    # serving (for health) once the controller knows us: before that no partition can be placed here
    await _wait_either(registered, stop)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("sluice.transferqueue.v1.StorageShard", health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "shard serving",
        extra={
            "port": port,
            "shard_id": shard_id,
            "address": address,
            "max_rows": config.max_rows,
            "max_bytes": config.max_bytes,
        },
    )
    try:
        await stop.wait()
    finally:
        log.info("shard stopping", extra={"grace_s": config.grace_s})
        await health_servicer.enter_graceful_shutdown()
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await server.stop(config.grace_s)
        if store.journal is not None:
            store.journal.close()
        log.info("shard stopped")


async def _wait_either(a: asyncio.Event, b: asyncio.Event) -> None:
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()
