"""ControllerClient: the only code that knows the controller's wire API."""

from __future__ import annotations

from services.transferqueue.client.channel import GrpcTransport
from services.transferqueue.client.rpc_pair import rpc_pair
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.transferqueue.pb import transferqueue_pb2_grpc as pb_grpc


class ControllerClient(GrpcTransport):
    stub_class = pb_grpc.ControllerStub

    # ------------------------------------------------------------ partitions

    def _create_partition(self, name: str, group_size: int = 1, exist_ok: bool = False, placement_block: int = 0):
        return "CreatePartition", pb.CreatePartitionRequest(
            name=name, group_size=group_size, exist_ok=exist_ok, placement_block=placement_block
        )

    def _get_partition(self, name: str):
        return "GetPartition", pb.GetPartitionRequest(name=name)

    def _list_partitions(self, prefix: str = ""):
        return "ListPartitions", pb.ListPartitionsRequest(prefix=prefix)

    def _clear_partition(self, name: str):
        return "ClearPartition", pb.ClearPartitionRequest(name=name)

    def _seal_partition(self, name: str):
        return "SealPartition", pb.SealPartitionRequest(name=name)

    create_partition, acreate_partition = rpc_pair(_create_partition)
    get_partition, aget_partition = rpc_pair(_get_partition)
    list_partitions, alist_partitions = rpc_pair(_list_partitions)
    clear_partition, aclear_partition = rpc_pair(_clear_partition)
    seal_partition, aseal_partition = rpc_pair(_seal_partition)

    # ------------------------------------------------------------ tasks

    def _register_task(self, name: str, required_fields, group_size: int = 1):
        return "RegisterTask", pb.RegisterTaskRequest(
            name=name, required_fields=list(required_fields), group_size=group_size
        )

    def _list_tasks(self):
        return "ListTasks", pb.ListTasksRequest()

    def _reset_task(self, partition: str, task: str):
        return "ResetTask", pb.ResetTaskRequest(partition=partition, task=task)

    register_task, aregister_task = rpc_pair(_register_task)
    list_tasks, alist_tasks = rpc_pair(_list_tasks)
    reset_task, areset_task = rpc_pair(_reset_task)

    # ------------------------------------------------------------ puts and reads

    def _prepare_put(self, partition: str, fields, new_rows: int = 0, rows=()):
        return "PreparePut", pb.PreparePutRequest(partition=partition, fields=fields, new_rows=new_rows, rows=rows)

    def _commit_put(self, partition: str, fields, rows, stored=()):
        """`stored`: (shard id, incarnation) of each shard that took the put's bytes."""
        return "CommitPut", pb.CommitPutRequest(
            partition=partition,
            fields=fields,
            rows=rows,
            stored=[pb.ShardIncarnation(shard_id=shard, incarnation=inc) for shard, inc in stored],
        )

    def _check_rows(self, partition: str, rows, fields):
        return "CheckRows", pb.CheckRowsRequest(partition=partition, rows=rows, fields=fields)

    def _get_schema(self, partition: str):
        return "GetSchema", pb.GetSchemaRequest(partition=partition)

    def _lost_rows(self, partition: str, task: str, from_row: int = 0, limit: int = 0):
        return "LostRows", pb.LostRowsRequest(partition=partition, task=task, from_row=from_row, limit=limit)

    prepare_put, aprepare_put = rpc_pair(_prepare_put)
    commit_put, acommit_put = rpc_pair(_commit_put)
    check_rows, acheck_rows = rpc_pair(_check_rows)
    get_schema, aget_schema = rpc_pair(_get_schema)
    lost_rows, alost_rows = rpc_pair(_lost_rows)

    # ------------------------------------------------------------ claims

    def _claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        wait_ms: int = 0,
        lease_ms: int = 0,
        min_rows: int = 0,
        claim_key: str = "",
    ):
        return "Claim", pb.ClaimRequest(
            partition=partition,
            task=task,
            batch_size=batch_size,
            wait_ms=wait_ms,
            lease_ms=lease_ms,
            min_rows=min_rows,
            claim_key=claim_key,
        )

    def _ack(self, lease_id: str, rows=()):
        return "Ack", pb.AckRequest(lease_id=lease_id, rows=rows)

    def _release(self, lease_id: str):
        return "Release", pb.ReleaseRequest(lease_id=lease_id)

    def _extend_lease(self, lease_id: str, lease_ms: int):
        return "ExtendLease", pb.ExtendLeaseRequest(lease_id=lease_id, lease_ms=lease_ms)

    def _wait_ready(self, partition: str, task: str, min_rows: int, wait_ms: int):
        return "WaitReady", pb.WaitReadyRequest(partition=partition, task=task, min_rows=min_rows, wait_ms=wait_ms)

    claim, aclaim = rpc_pair(_claim)
    ack, aack = rpc_pair(_ack)
    release, arelease = rpc_pair(_release)
    extend_lease, aextend_lease = rpc_pair(_extend_lease)
    wait_ready, await_ready = rpc_pair(_wait_ready)

    # ------------------------------------------------------------ shards

    def _register_shard(self, shard_id: str, address: str, ttl_ms: int, incarnation: str = ""):
        return "RegisterShard", pb.RegisterShardRequest(
            shard_id=shard_id, address=address, ttl_ms=ttl_ms, incarnation=incarnation
        )

    def _list_shards(self):
        return "ListShards", pb.ListShardsRequest()

    register_shard, aregister_shard = rpc_pair(_register_shard)
    list_shards, alist_shards = rpc_pair(_list_shards)
