"""The controller's view of TransferQueue metadata: a thin typed layer over the Redis functions in
tq_functions.lua. Every mutation is one function call, hence atomic in Redis."""

from __future__ import annotations

import json
import pathlib
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, cast

import grpc
from redis.exceptions import ResponseError

from services.runtime.redis_clients import async_redis
from services.transferqueue.errors import TQError, task_applies
from services.transferqueue.pb import transferqueue_pb2 as pb

_FUNCTIONS = (pathlib.Path(__file__).parent / "tq_functions.lua").read_text()


def canonical_schema(field: pb.FieldSchema) -> str:
    """One spelling per schema, whatever language wrote the request, so Redis can compare strings."""
    return json.dumps(
        {"dtype": field.dtype, "kind": pb.FieldKind.Name(field.kind), "shape": list(field.shape)},
        separators=(",", ":"),
        sort_keys=True,
    )


def schema_from_json(name: str, text: str) -> pb.FieldSchema:
    d = json.loads(text)
    return pb.FieldSchema(name=name, dtype=d["dtype"], kind=pb.FieldKind.Value(d["kind"]), shape=d["shape"])


@dataclass
class ClaimResult:
    lease_id: str
    groups: list[int]
    expiry_ms: int  # the lease's expiry, or (no claim) the next lease expiry of the task, 0 if none
    complete: bool
    group_size: int
    ready_groups_left: int

    @property
    def rows(self) -> list[int]:
        gs = self.group_size
        return [g * gs + i for g in self.groups for i in range(gs)]


class RedisMetadata:
    def __init__(
        self,
        redis_url: str,
        prefix: str = "tq",
        max_partitions: int = 100_000,
        max_tasks: int = 10_000,
        max_partition_rows: int = 1 << 24,
        max_readiness_rows: int = 1 << 20,
    ):
        self.redis = async_redis(redis_url)
        self.prefix = prefix
        self.events_channel = f"{prefix}:events"
        self.max_partitions = max_partitions
        self.max_tasks = max_tasks
        self.max_partition_rows = max_partition_rows
        self.max_readiness_rows = max_readiness_rows

    async def load_functions(self) -> None:
        await self.redis.function_load(_FUNCTIONS, replace=True)

    async def reservation_key(self) -> bytes:
        """The key put reservations are signed with: created once, shared by every controller replica."""
        key = f"{self.prefix}:reservation_key"
        await self.redis.set(key, secrets.token_hex(32), nx=True)
        return bytes.fromhex(cast(str, await self.redis.get(key)))  # set just above; a decode_responses client

    async def close(self) -> None:
        await self.redis.aclose()

    async def _call(self, name: str, *args):
        try:
            return await self.redis.fcall(name, 0, self.prefix, *args)
        except ResponseError as exc:
            text = str(exc).split(" script: ")[0]
            code_name, _, message = text.partition(" ")
            code = getattr(grpc.StatusCode, code_name, None)
            if code is None:
                raise
            raise TQError(code, message) from None

    # ------------------------------------------------------------ partitions

    async def create_partition(self, name: str, group_size: int, block: int, exist_ok: bool) -> None:
        await self._call("tq_create_partition", name, group_size, block, int(exist_ok), self.max_partitions)

    async def clear_partition(self, name: str) -> tuple[bool, list[str]]:
        existed, shards = await self._call("tq_clear_partition", name)
        return bool(existed), [s for s in (shards or "").split(",") if s]

    async def seal_partition(self, name: str) -> None:
        await self._call("tq_seal_partition", name)

    async def partition_names(self, prefix: str = "") -> list[str]:
        names = cast(list[str], await self.redis.zrange(f"{self.prefix}:partitions", 0, -1))
        return [n for n in names if n.startswith(prefix)]

    async def placement(self, name: str) -> pb.PartitionInfo:
        """Only what clients need to route rows: name, group size, shards, block (one Redis read)."""
        gs, block, shards = cast(list[Any], await self.redis.hmget(f"{self.prefix}:p:{name}", "gs", "block", "shards"))
        if gs is None:
            raise TQError(grpc.StatusCode.NOT_FOUND, f"partition {name} does not exist")
        return pb.PartitionInfo(
            name=name, group_size=int(gs), placement_block=int(block), shard_ids=[s for s in shards.split(",") if s]
        )

    async def partition_info(self, name: str) -> pb.PartitionInfo:
        pk = f"{self.prefix}:p:{name}"
        async with self.redis.pipeline(transaction=True) as pipe:
            for suffix in ("", ":fcount", ":nready", ":consumed", ":leased", ":schema", ":tlost"):
                pipe.hgetall(pk + suffix)
            pipe.hgetall(f"{self.prefix}:tasks")
            meta, fcount, nready, consumed, leased, schema, lost, tasks = await pipe.execute()
        if not meta:
            raise TQError(grpc.StatusCode.NOT_FOUND, f"partition {name} does not exist")
        return pb.PartitionInfo(
            name=name,
            group_size=int(meta["gs"]),
            rows=int(meta["rows"]),
            allocated_rows=int(meta["alloc"]),
            sealed=meta["sealed"] == "1",
            shard_ids=[s for s in meta["shards"].split(",") if s],
            placement_block=int(meta["block"]),
            created_unix=int(meta["created"]) / 1000.0,
            fields=[pb.FieldProgress(field=f, produced=int(n)) for f, n in sorted(fcount.items())],
            tasks=[
                pb.TaskProgress(
                    task=t,
                    ready=int(nready.get(t, 0)),
                    consumed=int(consumed.get(t, 0)),
                    leased=int(leased.get(t, 0)),
                    lost=int(lost.get(t, 0)),
                )
                for t in sorted(tasks)
                if task_applies(name, t)
            ],
            schema=[schema_from_json(f, s) for f, s in sorted(schema.items())],
            lost_rows=int(meta.get("lost", 0)),
        )

    # ------------------------------------------------------------ tasks

    async def register_task(self, name: str, fields: list[str], group_size: int) -> None:
        definition = json.dumps({"fields": list(fields), "group_size": group_size}, separators=(",", ":"))
        await self._call("tq_register_task", name, definition, self.max_tasks, self.max_readiness_rows)

    async def tasks(self) -> list[pb.TaskInfo]:
        raw = cast(dict[str, str], await self.redis.hgetall(f"{self.prefix}:tasks"))
        out = []
        for name, text in sorted(raw.items()):
            d = json.loads(text)
            out.append(pb.TaskInfo(name=name, required_fields=d["fields"], group_size=int(d["group_size"])))
        return out

    async def reset_task(self, partition: str, task: str) -> int:
        return int(await self._call("tq_reset_task", partition, task, self.max_readiness_rows))

    # ------------------------------------------------------------ puts

    @staticmethod
    def _schema_args(fields) -> list:
        args: list = [len(fields)]
        for f in fields:
            args += [f.name, canonical_schema(f)]
        return args

    async def prepare_put(self, partition: str, fields, new_rows: int, rows: list[int]) -> list[int]:
        first = int(
            await self._call(
                "tq_prepare_put", partition, self.max_partition_rows, *self._schema_args(fields), new_rows, *rows
            )
        )
        return list(range(first, first + new_rows)) if new_rows > 0 else list(rows)

    async def commit_put(self, partition: str, fields, rows: list[int], stored=()) -> int:
        """`stored`: (shard id, incarnation) of each shard that took the bytes (checked: ABORTED if one
        changed since)."""
        pairs = [x for shard, inc in stored for x in (shard, inc)]
        return int(await self._call("tq_commit_put", partition, *self._schema_args(fields), len(stored), *pairs, *rows))

    async def check_rows(self, partition: str, rows: list[int], fields: list[str]) -> None:
        await self._call("tq_check_rows", partition, *fields, "--", *rows)

    async def schema(self, partition: str) -> list[pb.FieldSchema]:
        pk = f"{self.prefix}:p:{partition}"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.exists(pk)
            pipe.hgetall(pk + ":schema")
            exists, schema = await pipe.execute()
        if not exists:
            raise TQError(grpc.StatusCode.NOT_FOUND, f"partition {partition} does not exist")
        return [schema_from_json(f, s) for f, s in sorted(schema.items())]

    # ------------------------------------------------------------ claims

    async def claim(
        self, partition: str, task: str, batch_rows: int, min_rows: int, lease_ms: int, claim_key: str
    ) -> ClaimResult:
        lease_id = uuid.uuid4().hex
        res = await self._call("tq_claim", partition, task, batch_rows, min_rows, lease_ms, lease_id, claim_key)
        lease, csv, expiry, complete, gs, left = res
        return ClaimResult(
            lease_id=lease,
            groups=[int(g) for g in csv.split(",") if g] if csv else [],
            expiry_ms=int(expiry),
            complete=bool(complete),
            group_size=int(gs),
            ready_groups_left=int(left),
        )

    async def ready(self, partition: str, task: str) -> tuple[int, bool, int]:
        ready, complete, next_expiry = await self._call("tq_ready", partition, task)
        return int(ready), bool(complete), int(next_expiry)

    async def ack(self, lease_id: str, rows: list[int]) -> int:
        return int(await self._call("tq_ack", lease_id, *rows))

    async def release(self, lease_id: str) -> int:
        return int(await self._call("tq_release", lease_id))

    async def extend_lease(self, lease_id: str, lease_ms: int) -> int:
        return int(await self._call("tq_extend_lease", lease_id, lease_ms))

    # ------------------------------------------------------------ shards

    async def register_shard(
        self, shard_id: str, address: str, ttl_ms: int, incarnation: str = ""
    ) -> tuple[bool, list[str]]:
        """-> (the shard came back without its data, live partitions). After a True, mark its rows lost
        (mark_shard_lost) and then store the new incarnation (shard_incarnation)."""
        reborn, *live = await self._call("tq_register_shard", shard_id, address, ttl_ms, incarnation)
        return bool(reborn), list(live)

    async def mark_shard_lost(self, shard_id: str, partitions: list[str], window: int = 4096) -> dict[str, int]:
        """Mark lost every committed row placed on the shard, partition by partition, in windows of rows
        (each one bounded Redis call). -> groups newly lost per partition (those with any)."""
        lost: dict[str, int] = {}
        for name in partitions:
            alloc = await self.redis.hget(f"{self.prefix}:p:{name}", "alloc")
            for start in range(0, int(alloc or 0), window):
                groups, _ = await self._call("tq_mark_lost", name, shard_id, start, start + window)
                if groups:
                    lost[name] = lost.get(name, 0) + int(groups)
        return lost

    async def shard_incarnation(self, shard_id: str, incarnation: str) -> None:
        await self._call("tq_shard_incarnation", shard_id, incarnation)

    async def lost_rows(self, partition: str, task: str, from_row: int, limit: int) -> list[int]:
        return [int(r) for r in await self._call("tq_lost_rows", partition, task, from_row, limit)]

    async def shards(self) -> dict[str, str]:
        flat = await self._call("tq_list_shards")
        return dict(zip(flat[0::2], flat[1::2]))
