from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FieldKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIELD_KIND_UNSPECIFIED: _ClassVar[FieldKind]
    SCALAR: _ClassVar[FieldKind]
    TENSOR: _ClassVar[FieldKind]
    RAGGED: _ClassVar[FieldKind]
    STRING: _ClassVar[FieldKind]
FIELD_KIND_UNSPECIFIED: FieldKind
SCALAR: FieldKind
TENSOR: FieldKind
RAGGED: FieldKind
STRING: FieldKind

class FieldSchema(_message.Message):
    __slots__ = ("name", "dtype", "kind", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    kind: FieldKind
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., kind: _Optional[_Union[FieldKind, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TaskProgress(_message.Message):
    __slots__ = ("task", "ready", "consumed", "leased", "lost")
    TASK_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    task: str
    ready: int
    consumed: int
    leased: int
    lost: int
    def __init__(self, task: _Optional[str] = ..., ready: _Optional[int] = ..., consumed: _Optional[int] = ..., leased: _Optional[int] = ..., lost: _Optional[int] = ...) -> None: ...

class FieldProgress(_message.Message):
    __slots__ = ("field", "produced")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_FIELD_NUMBER: _ClassVar[int]
    field: str
    produced: int
    def __init__(self, field: _Optional[str] = ..., produced: _Optional[int] = ...) -> None: ...

class PartitionInfo(_message.Message):
    __slots__ = ("name", "group_size", "rows", "allocated_rows", "sealed", "shard_ids", "placement_block", "fields", "tasks", "created_unix", "schema", "lost_rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_ROWS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    SHARD_IDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LOST_ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    group_size: int
    rows: int
    allocated_rows: int
    sealed: bool
    shard_ids: _containers.RepeatedScalarFieldContainer[str]
    placement_block: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldProgress]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskProgress]
    created_unix: float
    schema: _containers.RepeatedCompositeFieldContainer[FieldSchema]
    lost_rows: int
    def __init__(self, name: _Optional[str] = ..., group_size: _Optional[int] = ..., rows: _Optional[int] = ..., allocated_rows: _Optional[int] = ..., sealed: _Optional[bool] = ..., shard_ids: _Optional[_Iterable[str]] = ..., placement_block: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldProgress, _Mapping]]] = ..., tasks: _Optional[_Iterable[_Union[TaskProgress, _Mapping]]] = ..., created_unix: _Optional[float] = ..., schema: _Optional[_Iterable[_Union[FieldSchema, _Mapping]]] = ..., lost_rows: _Optional[int] = ...) -> None: ...

class CreatePartitionRequest(_message.Message):
    __slots__ = ("name", "group_size", "exist_ok", "placement_block")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    name: str
    group_size: int
    exist_ok: bool
    placement_block: int
    def __init__(self, name: _Optional[str] = ..., group_size: _Optional[int] = ..., exist_ok: _Optional[bool] = ..., placement_block: _Optional[int] = ...) -> None: ...

class GetPartitionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListPartitionsRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class ListPartitionsResponse(_message.Message):
    __slots__ = ("partitions",)
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionInfo]
    def __init__(self, partitions: _Optional[_Iterable[_Union[PartitionInfo, _Mapping]]] = ...) -> None: ...

class ClearPartitionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ClearPartitionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class SealPartitionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RegisterTaskRequest(_message.Message):
    __slots__ = ("name", "required_fields", "group_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    required_fields: _containers.RepeatedScalarFieldContainer[str]
    group_size: int
    def __init__(self, name: _Optional[str] = ..., required_fields: _Optional[_Iterable[str]] = ..., group_size: _Optional[int] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("name", "required_fields", "group_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    required_fields: _containers.RepeatedScalarFieldContainer[str]
    group_size: int
    def __init__(self, name: _Optional[str] = ..., required_fields: _Optional[_Iterable[str]] = ..., group_size: _Optional[int] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskInfo]
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskInfo, _Mapping]]] = ...) -> None: ...

class PreparePutRequest(_message.Message):
    __slots__ = ("partition", "fields", "new_rows", "rows")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    NEW_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    partition: str
    fields: _containers.RepeatedCompositeFieldContainer[FieldSchema]
    new_rows: int
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, partition: _Optional[str] = ..., fields: _Optional[_Iterable[_Union[FieldSchema, _Mapping]]] = ..., new_rows: _Optional[int] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class PreparePutResponse(_message.Message):
    __slots__ = ("rows", "partition", "reservation")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    partition: PartitionInfo
    reservation: bytes
    def __init__(self, rows: _Optional[_Iterable[int]] = ..., partition: _Optional[_Union[PartitionInfo, _Mapping]] = ..., reservation: _Optional[bytes] = ...) -> None: ...

class CommitPutRequest(_message.Message):
    __slots__ = ("partition", "fields", "rows", "stored")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    partition: str
    fields: _containers.RepeatedCompositeFieldContainer[FieldSchema]
    rows: _containers.RepeatedScalarFieldContainer[int]
    stored: _containers.RepeatedCompositeFieldContainer[ShardIncarnation]
    def __init__(self, partition: _Optional[str] = ..., fields: _Optional[_Iterable[_Union[FieldSchema, _Mapping]]] = ..., rows: _Optional[_Iterable[int]] = ..., stored: _Optional[_Iterable[_Union[ShardIncarnation, _Mapping]]] = ...) -> None: ...

class ShardIncarnation(_message.Message):
    __slots__ = ("shard_id", "incarnation")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    incarnation: str
    def __init__(self, shard_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class CommitPutResponse(_message.Message):
    __slots__ = ("rows_committed",)
    ROWS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    rows_committed: int
    def __init__(self, rows_committed: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("partition", "task", "batch_size", "min_rows", "wait_ms", "lease_ms", "claim_key")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_ROWS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_KEY_FIELD_NUMBER: _ClassVar[int]
    partition: str
    task: str
    batch_size: int
    min_rows: int
    wait_ms: int
    lease_ms: int
    claim_key: str
    def __init__(self, partition: _Optional[str] = ..., task: _Optional[str] = ..., batch_size: _Optional[int] = ..., min_rows: _Optional[int] = ..., wait_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ..., claim_key: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("lease_id", "rows", "lease_expires_unix_ms", "partition_complete", "group_size")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    lease_expires_unix_ms: int
    partition_complete: bool
    group_size: int
    def __init__(self, lease_id: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ..., lease_expires_unix_ms: _Optional[int] = ..., partition_complete: _Optional[bool] = ..., group_size: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("lease_id", "rows")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("rows_acked",)
    ROWS_ACKED_FIELD_NUMBER: _ClassVar[int]
    rows_acked: int
    def __init__(self, rows_acked: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("rows_released",)
    ROWS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    rows_released: int
    def __init__(self, rows_released: _Optional[int] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ExtendLeaseResponse(_message.Message):
    __slots__ = ("lease_expires_unix_ms",)
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix_ms: int
    def __init__(self, lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class ResetTaskRequest(_message.Message):
    __slots__ = ("partition", "task")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    partition: str
    task: str
    def __init__(self, partition: _Optional[str] = ..., task: _Optional[str] = ...) -> None: ...

class ResetTaskResponse(_message.Message):
    __slots__ = ("rows_ready",)
    ROWS_READY_FIELD_NUMBER: _ClassVar[int]
    rows_ready: int
    def __init__(self, rows_ready: _Optional[int] = ...) -> None: ...

class GetSchemaRequest(_message.Message):
    __slots__ = ("partition",)
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    partition: str
    def __init__(self, partition: _Optional[str] = ...) -> None: ...

class GetSchemaResponse(_message.Message):
    __slots__ = ("fields",)
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.RepeatedCompositeFieldContainer[FieldSchema]
    def __init__(self, fields: _Optional[_Iterable[_Union[FieldSchema, _Mapping]]] = ...) -> None: ...

class WaitReadyRequest(_message.Message):
    __slots__ = ("partition", "task", "min_rows", "wait_ms")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MIN_ROWS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    partition: str
    task: str
    min_rows: int
    wait_ms: int
    def __init__(self, partition: _Optional[str] = ..., task: _Optional[str] = ..., min_rows: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class WaitReadyResponse(_message.Message):
    __slots__ = ("ready_rows", "partition_complete")
    READY_ROWS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ready_rows: int
    partition_complete: bool
    def __init__(self, ready_rows: _Optional[int] = ..., partition_complete: _Optional[bool] = ...) -> None: ...

class CheckRowsRequest(_message.Message):
    __slots__ = ("partition", "rows", "fields")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    partition: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, partition: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ..., fields: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckRowsResponse(_message.Message):
    __slots__ = ("partition",)
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    partition: PartitionInfo
    def __init__(self, partition: _Optional[_Union[PartitionInfo, _Mapping]] = ...) -> None: ...

class LostRowsRequest(_message.Message):
    __slots__ = ("partition", "task", "from_row", "limit")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    FROM_ROW_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    partition: str
    task: str
    from_row: int
    limit: int
    def __init__(self, partition: _Optional[str] = ..., task: _Optional[str] = ..., from_row: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class LostRowsResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rows: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterShardRequest(_message.Message):
    __slots__ = ("shard_id", "address", "ttl_ms", "incarnation")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    address: str
    ttl_ms: int
    incarnation: str
    def __init__(self, shard_id: _Optional[str] = ..., address: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterShardResponse(_message.Message):
    __slots__ = ("live_partitions", "reservation_key")
    LIVE_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_KEY_FIELD_NUMBER: _ClassVar[int]
    live_partitions: _containers.RepeatedScalarFieldContainer[str]
    reservation_key: bytes
    def __init__(self, live_partitions: _Optional[_Iterable[str]] = ..., reservation_key: _Optional[bytes] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_id", "address")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    address: str
    def __init__(self, shard_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("partition", "rows", "total_bytes", "reservation")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    partition: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    reservation: bytes
    def __init__(self, partition: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., reservation: _Optional[bytes] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("rows", "bytes", "incarnation")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    rows: int
    bytes: int
    incarnation: str
    def __init__(self, rows: _Optional[int] = ..., bytes: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("partition", "rows", "fields")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    partition: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, partition: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ..., fields: _Optional[_Iterable[str]] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("total_bytes", "data")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("partition", "rows", "fields")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    partition: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, partition: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ..., fields: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("cells",)
    CELLS_FIELD_NUMBER: _ClassVar[int]
    cells: int
    def __init__(self, cells: _Optional[int] = ...) -> None: ...

class DropPartitionRequest(_message.Message):
    __slots__ = ("partition",)
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    partition: str
    def __init__(self, partition: _Optional[str] = ...) -> None: ...

class DropPartitionResponse(_message.Message):
    __slots__ = ("existed", "bytes_freed")
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    bytes_freed: int
    def __init__(self, existed: _Optional[bool] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("shard_id", "rows", "bytes", "max_rows", "max_bytes", "partitions")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    rows: int
    bytes: int
    max_rows: int
    max_bytes: int
    partitions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shard_id: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., max_rows: _Optional[int] = ..., max_bytes: _Optional[int] = ..., partitions: _Optional[_Iterable[str]] = ...) -> None: ...
