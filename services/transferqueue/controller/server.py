"""The TransferQueue controller: gRPC servicer over RedisMetadata. Metadata only; it never sees
sample bytes (it only tells shards to drop a cleared partition)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from services.runtime.grpc_auth import BearerTokenInterceptor
from services.runtime.grpc_strict import add_strict_servicer
from services.runtime.grpc_tls import add_port, with_tls
from services.runtime.redis_events import RedisEvents
from services.transferqueue.client.shard_client import ShardClient
from services.transferqueue.controller.config import ControllerConfig
from services.transferqueue.controller.metadata import RedisMetadata
from services.transferqueue import reservation
from services.transferqueue.bounds import Limits, check_field_names, check_int, check_rows, check_schemas, invalid
from services.transferqueue.errors import TQError, check_name
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.transferqueue.pb import transferqueue_pb2_grpc as pb_grpc
from services.transferqueue.rpc import unary_handler

log = logging.getLogger(__name__)

ROWS_COMMITTED = Counter("sluice_tq_rows_committed_total", "rows committed by puts")
ROWS_CLAIMED = Counter("sluice_tq_rows_claimed_total", "rows handed out by claims", ["task"])
ROWS_ACKED = Counter("sluice_tq_rows_acked_total", "rows acknowledged", [])
ROWS_LOST = Counter("sluice_tq_groups_lost_total", "groups lost with a shard that came back without its data")
WAITING_CLAIMS = Gauge("sluice_tq_waiting_claims", "claims currently long-polling")

SERVER = "controller"
# If a pub/sub message is lost (Redis restart), a waiter still re-checks this often.
MAX_SLEEP_S = 2.0


_invalid = invalid
MAX_ADDRESS_CHARS = 256
MAX_LOST_ROWS = 65536
MAX_STORED_SHARDS = 1024


class ControllerServicer(pb_grpc.ControllerServicer):
    def __init__(
        self, config: ControllerConfig, meta: RedisMetadata, events: RedisEvents, reservation_key: bytes = b""
    ):
        self.config = config
        self.meta = meta
        self.events = events
        self.reservation_key = reservation_key
        self.limits = Limits(
            max_rows_per_call=config.max_rows_per_call,
            max_partition_rows=config.max_partition_rows,
            max_fields_per_call=config.max_fields_per_call,
            max_row_elements=config.max_row_elements,
        )

    # ------------------------------------------------------------ partitions

    @unary_handler(SERVER)
    async def CreatePartition(self, request, context):
        check_name("partition", request.name)
        # a group must fit in one claim; a block is a range of row indices
        group_size = check_int("group_size", request.group_size or 1, 1, self.config.max_rows_per_call)
        block = check_int("placement_block", request.placement_block or 64, 1, self.config.max_partition_rows)
        await self.meta.create_partition(request.name, group_size, block, request.exist_ok)
        return await self.meta.partition_info(request.name)

    @unary_handler(SERVER)
    async def GetPartition(self, request, context):
        return await self.meta.partition_info(check_name("partition", request.name))

    @unary_handler(SERVER)
    async def ListPartitions(self, request, context):
        check_int("prefix length", len(request.prefix), 0, 300)
        infos = []
        for name in await self.meta.partition_names(request.prefix):
            try:
                infos.append(await self.meta.partition_info(name))
            except TQError:  # cleared between the listing and the read
                continue
        return pb.ListPartitionsResponse(partitions=infos)

    @unary_handler(SERVER)
    async def ClearPartition(self, request, context):
        name = check_name("partition", request.name)
        existed, shard_ids = await self.meta.clear_partition(name)
        if shard_ids:
            await self._drop_on_shards(name, shard_ids)
        return pb.ClearPartitionResponse(existed=existed)

    async def _drop_on_shards(self, partition: str, shard_ids: list[str]) -> None:
        """Best effort: a shard that misses this drops the partition on its next registration."""
        addresses = await self.meta.shards()

        async def drop(shard_id: str) -> None:
            address = addresses.get(shard_id)
            if address is None:
                return
            # shards of a TLS controller serve TLS too
            client = ShardClient(
                with_tls(address, bool(self.config.tls_cert_file)), token=self.config.auth_token or None
            )
            try:
                await client.adrop_partition(partition, timeout=self.config.shard_call_timeout_s)
            except Exception as exc:
                log.warning("shard drop failed", extra={"shard": shard_id, "partition": partition, "error": str(exc)})
            finally:
                await client.aclose()

        await asyncio.gather(*(drop(s) for s in shard_ids))

    @unary_handler(SERVER)
    async def SealPartition(self, request, context):
        name = check_name("partition", request.name)
        await self.meta.seal_partition(name)
        self.events.fire(name)  # as after a commit
        return await self.meta.partition_info(name)

    # ------------------------------------------------------------ tasks

    @unary_handler(SERVER)
    async def RegisterTask(self, request, context):
        check_name("task", request.name)
        if not request.required_fields:
            raise _invalid(f"task {request.name} must require at least one field")
        check_field_names("required_fields", request.required_fields, self.limits)
        group_size = check_int("group_size", request.group_size or 1, 1, self.config.max_rows_per_call)
        await self.meta.register_task(request.name, list(request.required_fields), group_size)
        return pb.TaskInfo(name=request.name, required_fields=request.required_fields, group_size=group_size)

    @unary_handler(SERVER)
    async def ListTasks(self, request, context):
        return pb.ListTasksResponse(tasks=await self.meta.tasks())

    @unary_handler(SERVER)
    async def ResetTask(self, request, context):
        ready = await self.meta.reset_task(check_name("partition", request.partition), check_name("task", request.task))
        return pb.ResetTaskResponse(rows_ready=ready)

    # ------------------------------------------------------------ puts

    @unary_handler(SERVER)
    async def PreparePut(self, request, context):
        check_name("partition", request.partition)
        check_schemas(request.fields, self.limits)
        if request.new_rows < 0 or (request.new_rows > 0) == bool(request.rows):
            raise _invalid("give either new_rows > 0 or the existing rows to write")
        check_int("new_rows", request.new_rows, 0, self.config.max_rows_per_call)
        check_rows("rows", request.rows, self.limits)
        rows = await self.meta.prepare_put(request.partition, request.fields, request.new_rows, list(request.rows))
        signed = reservation.issue(self.reservation_key, request.partition, rows, self.config.reservation_ttl_s)
        return pb.PreparePutResponse(
            rows=rows, partition=await self.meta.placement(request.partition), reservation=signed
        )

    @unary_handler(SERVER)
    async def CommitPut(self, request, context):
        check_name("partition", request.partition)
        if not request.fields or not request.rows:
            raise _invalid("a commit needs fields and rows")
        check_schemas(request.fields, self.limits)
        check_rows("rows", request.rows, self.limits)
        if len(request.stored) > MAX_STORED_SHARDS:
            raise _invalid(f"a commit names at most {MAX_STORED_SHARDS} shards in stored")
        for s in request.stored:
            check_name("shard", s.shard_id)
            if len(s.incarnation) > MAX_ADDRESS_CHARS:
                raise _invalid(f"incarnation is over {MAX_ADDRESS_CHARS} characters")
        n = await self.meta.commit_put(
            request.partition, request.fields, list(request.rows), [(s.shard_id, s.incarnation) for s in request.stored]
        )
        # this replica's waiters wake now; the Redis message (for the other replicas) comes a hop later
        self.events.fire(request.partition)
        ROWS_COMMITTED.inc(n)
        return pb.CommitPutResponse(rows_committed=n)

    @unary_handler(SERVER)
    async def CheckRows(self, request, context):
        check_name("partition", request.partition)
        if not request.fields:
            raise _invalid("name the fields to read")
        check_field_names("fields", request.fields, self.limits)
        check_rows("rows", request.rows, self.limits, allow_repeats=True)
        await self.meta.check_rows(request.partition, list(request.rows), list(request.fields))
        return pb.CheckRowsResponse(partition=await self.meta.placement(request.partition))

    @unary_handler(SERVER)
    async def GetSchema(self, request, context):
        return pb.GetSchemaResponse(fields=await self.meta.schema(check_name("partition", request.partition)))

    # ------------------------------------------------------------ claims

    @unary_handler(SERVER)
    async def Claim(self, request, context):
        partition = check_name("partition", request.partition)
        task = check_name("task", request.task)
        check_int("batch_size", request.batch_size, 1, self.config.max_rows_per_call)
        check_int("min_rows", request.min_rows, 0, self.config.max_rows_per_call)
        check_int("wait_ms", request.wait_ms, 0, (1 << 63) - 1)
        lease_ms = check_int("lease_ms", request.lease_ms or self.config.default_lease_ms, 1, self.config.max_lease_ms)
        if request.claim_key:
            check_name("claim_key", request.claim_key)
        min_rows = request.min_rows or request.batch_size
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(request.wait_ms, self.config.max_wait_ms) / 1000.0
        waiting = False
        try:
            while True:
                last_try = loop.time() >= deadline
                event = self.events.waiter(partition)
                res = await self.meta.claim(
                    partition, task, request.batch_size, 1 if last_try else min_rows, lease_ms, request.claim_key
                )
                if res.lease_id or res.complete or last_try:
                    break
                if not waiting:
                    waiting = True
                    WAITING_CLAIMS.inc()
                sleep = min(deadline - loop.time(), MAX_SLEEP_S)
                if res.expiry_ms:  # a lease may expire before anything is published
                    sleep = min(sleep, max(0.001, res.expiry_ms / 1000.0 - time.time() + 0.002))
                try:
                    await asyncio.wait_for(event.wait(), timeout=max(sleep, 0.0))
                except TimeoutError:
                    pass
        finally:
            if waiting:
                WAITING_CLAIMS.dec()
        rows = res.rows
        if res.lease_id:
            ROWS_CLAIMED.labels(task).inc(len(rows))
        return pb.ClaimResponse(
            lease_id=res.lease_id,
            rows=rows,
            lease_expires_unix_ms=res.expiry_ms if res.lease_id else 0,
            partition_complete=res.complete,
            group_size=res.group_size,
        )

    @unary_handler(SERVER)
    async def WaitReady(self, request, context):
        partition = check_name("partition", request.partition)
        task = check_name("task", request.task)
        check_int("min_rows", request.min_rows, 0, self.config.max_partition_rows)
        check_int("wait_ms", request.wait_ms, 0, (1 << 63) - 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(request.wait_ms, self.config.max_wait_ms) / 1000.0
        while True:
            event = self.events.waiter(partition)
            ready, complete, _ = await self.meta.ready(partition, task)
            remaining = deadline - loop.time()
            if ready >= request.min_rows or complete or remaining <= 0:
                return pb.WaitReadyResponse(ready_rows=ready, partition_complete=complete)
            try:
                await asyncio.wait_for(event.wait(), timeout=min(remaining, MAX_SLEEP_S))
            except TimeoutError:
                pass

    def _lease_id(self, lease_id: str) -> str:
        if not lease_id or len(lease_id) > 64 or not (lease_id.isascii() and lease_id.isalnum()):
            raise _invalid(f"lease id {lease_id!r} is malformed")
        return lease_id

    @unary_handler(SERVER)
    async def Ack(self, request, context):
        lease_id = self._lease_id(request.lease_id)
        n = await self.meta.ack(lease_id, check_rows("rows", request.rows, self.limits))
        ROWS_ACKED.inc(n)
        return pb.AckResponse(rows_acked=n)

    @unary_handler(SERVER)
    async def Release(self, request, context):
        return pb.ReleaseResponse(rows_released=await self.meta.release(self._lease_id(request.lease_id)))

    @unary_handler(SERVER)
    async def ExtendLease(self, request, context):
        check_int("lease_ms", request.lease_ms, 1, self.config.max_lease_ms)
        expiry = await self.meta.extend_lease(self._lease_id(request.lease_id), request.lease_ms)
        return pb.ExtendLeaseResponse(lease_expires_unix_ms=expiry)

    @unary_handler(SERVER)
    async def LostRows(self, request, context):
        check_name("partition", request.partition)
        check_name("task", request.task)
        limit = check_int("limit", request.limit or MAX_LOST_ROWS, 1, MAX_LOST_ROWS)
        from_row = check_int("from_row", request.from_row, 0, self.config.max_partition_rows)
        rows = await self.meta.lost_rows(request.partition, request.task, from_row, limit)
        return pb.LostRowsResponse(rows=rows)

    # ------------------------------------------------------------ shards

    @unary_handler(SERVER)
    async def RegisterShard(self, request, context):
        check_name("shard", request.shard_id)
        if not request.address or ":" not in request.address or len(request.address) > MAX_ADDRESS_CHARS:
            raise _invalid(f"shard address {request.address[:MAX_ADDRESS_CHARS]!r} is not host:port")
        ttl = check_int("ttl_ms", request.ttl_ms or 15_000, 1, self.config.max_shard_ttl_ms)
        if len(request.incarnation) > MAX_ADDRESS_CHARS:
            raise _invalid(f"incarnation is over {MAX_ADDRESS_CHARS} characters")
        reborn, live = await self.meta.register_shard(request.shard_id, request.address, ttl, request.incarnation)
        if reborn:  # before the answer: the shard takes no put (it lacks the reservation key) until then
            lost = await self.meta.mark_shard_lost(request.shard_id, live)
            await self.meta.shard_incarnation(request.shard_id, request.incarnation)
            ROWS_LOST.inc(sum(lost.values()))
            log.warning(
                "a storage shard came back without its data: its rows are marked lost",
                extra={"shard_id": request.shard_id, "groups_lost": lost},
            )
        return pb.RegisterShardResponse(live_partitions=live, reservation_key=self.reservation_key)

    @unary_handler(SERVER)
    async def ListShards(self, request, context):
        shards = await self.meta.shards()
        return pb.ListShardsResponse(shards=[pb.ShardInfo(shard_id=k, address=v) for k, v in sorted(shards.items())])


async def serve(config: ControllerConfig, stop: asyncio.Event, on_bound=None) -> None:
    """Run until `stop` is set; then stop taking calls and give in-flight ones `grace_s`."""
    meta = RedisMetadata(
        config.redis_url,
        config.key_prefix,
        max_partitions=config.max_partitions,
        max_tasks=config.max_tasks,
        max_partition_rows=config.max_partition_rows,
        max_readiness_rows=config.max_readiness_rows,
    )
    await meta.load_functions()
    key = await meta.reservation_key()
    events = RedisEvents(meta.redis, meta.events_channel)
    events_task = asyncio.create_task(events.run())
    await asyncio.wait_for(events.subscribed.wait(), timeout=10)

    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    add_strict_servicer(
        server, ControllerServicer(config, meta, events, key), pb.DESCRIPTOR.services_by_name["Controller"]
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_port(server, f"{config.host}:{config.port}", config)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("sluice.transferqueue.v1.Controller", health_pb2.HealthCheckResponse.SERVING)
    log.info("controller serving", extra={"port": port, "redis": config.redis_url, "prefix": config.key_prefix})
    if on_bound:
        on_bound(port)
    try:
        await stop.wait()
    finally:
        log.info("controller stopping", extra={"grace_s": config.grace_s})
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.grace_s)
        events_task.cancel()
        await asyncio.gather(events_task, return_exceptions=True)
        await meta.close()
        log.info("controller stopped")
