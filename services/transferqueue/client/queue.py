"""AsyncTransferQueue (asyncio) and its blocking facade TransferQueue: the data plane as users see it.

A put: PreparePut (controller: validate schema, allocate rows) -> bytes to the shards that own the
rows, in parallel -> CommitPut (controller: rows become readable). If the commit fails the bytes are
deleted again and the caller gets the error. A read: Claim (controller: rows + lease) or CheckRows
-> bytes from the shards in parallel -> decoded columns. Each shard's part of either, retried while that shard is
away, is services/transferqueue/client/shards.py's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import grpc
import numpy as np

from services.transferqueue.client.controller_client import ControllerClient
from services.transferqueue.client.placement import Placement, merge_in_order, select
from services.transferqueue.client.shards import Shards
from services.transferqueue.codec import Backing, Batch, decode_table, encode_columns
from services.transferqueue.wire_format import from_ipc, to_ipc
from services.transferqueue.errors import TQError
from services.runtime.loop_thread import BlockingFacade, blocking_methods

# slack on top of a claim's long-poll wait for the RPC deadline
_WAIT_SLACK_S = 10.0
_LOST_RETRIES = 3  # claims given back, or puts made again, because a shard lost its data, before the error
_LOST_PAGE = 65536  # rows per LostRows call (the controller's limit)
# a CommitPut that failed with these was certainly not applied (unlike, say, a lost reply)
_COMMIT_REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.ABORTED,
    }
)


@dataclass
class ClaimedRows:
    partition: str
    task: str
    lease_id: str
    rows: list[int]
    complete: bool
    group_size: int
    lease_expires_unix_ms: int


class AsyncTransferQueue:
    """The data-plane client (asyncio). TransferQueue below is its blocking facade."""

    def __init__(
        self,
        controller: str,
        token: str | None = None,
        put_timeout_s: float = 60.0,
        chunk_bytes: int | None = None,
        shard_wait_s: float = 20.0,
    ):
        """`shard_wait_s`: how long a read waits for a shard that cannot be reached (a killed shard
        restarted by its supervisor replays its journal and is back in seconds) before UNAVAILABLE."""
        self.put_timeout_s = put_timeout_s
        self.shard_wait_s = shard_wait_s
        self.controller = ControllerClient(controller, token)
        self.shards = Shards(token, self.controller.tls, chunk_bytes)  # services/transferqueue/client/shards.py
        self._placements: dict[str, Placement] = {}
        self._task_fields: dict[str, list[str]] = {}

    @staticmethod
    def _claimed(partition: str, task: str, res) -> ClaimedRows:
        return ClaimedRows(
            partition,
            task,
            res.lease_id,
            list(res.rows),
            res.partition_complete,
            res.group_size,
            res.lease_expires_unix_ms,
        )

    @staticmethod
    def _decoded(partition: str, rows, fetched, padded, pad_value, lease_id: str = "") -> Batch:
        """fetched: [(positions in the request, received IPC bytes)] per shard."""
        tables = [(positions, from_ipc(data)) for positions, data in fetched]
        backing = Backing([data for _, data in fetched])
        columns, lengths = decode_table(merge_in_order(tables, len(rows)), padded, pad_value, backing)
        return Batch(partition=partition, rows=list(rows), columns=columns, lengths=lengths, lease_id=lease_id)

    async def close(self) -> None:
        await self.controller.aclose()
        await self.shards.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def create_partition(self, name: str, group_size: int = 1, exist_ok: bool = False, placement_block: int = 0):
        return await self.controller.acreate_partition(name, group_size, exist_ok, placement_block)

    async def partition(self, name: str):
        info = await self.controller.aget_partition(name)
        self._placements[name] = Placement.of(info)  # fixed for the partition's life: reads need no lookup
        return info

    async def list_partitions(self, prefix: str = ""):
        return list((await self.controller.alist_partitions(prefix)).partitions)

    async def seal_partition(self, name: str):
        return await self.controller.aseal_partition(name)

    async def clear_partition(self, name: str) -> bool:
        self._placements.pop(name, None)
        return (await self.controller.aclear_partition(name)).existed

    async def register_task(self, name: str, required_fields: Sequence[str], group_size: int = 1):
        self._task_fields[name] = list(required_fields)
        return await self.controller.aregister_task(name, required_fields, group_size)

    async def reset_task(self, partition: str, task: str) -> int:
        return (await self.controller.areset_task(partition, task)).rows_ready

    async def schema(self, partition: str):
        return list((await self.controller.aget_schema(partition)).fields)

    async def wait_ready(self, partition: str, task: str, min_rows: int, wait_s: float):
        return await self.controller.await_ready(
            partition, task, min_rows, int(wait_s * 1000), timeout=wait_s + _WAIT_SLACK_S
        )

    async def _placement(self, partition: str, info=None) -> Placement:
        if info is not None:
            self._placements[partition] = Placement.of(info)
        elif partition not in self._placements:
            self._placements[partition] = Placement.of(await self.controller.aget_partition(partition))
        placement = self._placements[partition]
        if not self.shards.knows(placement.shard_ids):
            self.shards.learn(await self.controller.alist_shards())
        return placement

    async def put(self, partition: str, columns: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[int]:
        """Store columns as new rows (or as fields of existing `rows`); returns the row indices.
        The rows are readable when this returns, and not before."""
        n, schemas, batch = encode_columns(columns)
        if rows is not None and len(rows) != n:
            raise TQError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(rows)} rows named for {n} rows of data")
        for attempt in range(_LOST_RETRIES + 1):
            try:
                return await self._put_once(partition, n, schemas, batch, rows)
            except TQError as err:
                # a shard came back without its data after it stored the bytes: the commit changed nothing
                if err.code != grpc.StatusCode.ABORTED or attempt == _LOST_RETRIES:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _put_once(self, partition: str, n: int, schemas, batch, rows: Sequence[int] | None) -> list[int]:
        prepared = await self.controller.aprepare_put(
            partition, schemas, 0 if rows is not None else n, list(rows) if rows is not None else []
        )
        rows = list(prepared.rows)
        plan = (await self._placement(partition, prepared.partition)).split(rows)
        row_array = np.asarray(rows, dtype=np.int64)

        stored = []
        fields = [s.name for s in schemas]

        async def send(shard_id, positions):
            data = to_ipc(select(batch, positions))
            incarnation = await self.shards.put(
                shard_id, partition, row_array[positions].tolist(), data, prepared.reservation, self.put_timeout_s
            )
            stored.append((shard_id, positions, incarnation))

        async def undo():
            for shard_id, positions, _ in stored:
                try:
                    await self.shards.client(shard_id).adelete(
                        partition, row_array[positions].tolist(), fields, timeout=5
                    )
                except TQError:
                    pass

        try:
            await asyncio.gather(*(send(s, p) for s, p in plan))
        except BaseException:
            await undo()
            raise
        try:
            await self.controller.acommit_put(partition, schemas, rows, [(s, inc) for s, _, inc in stored if inc])
        except TQError as err:
            if err.code in _COMMIT_REFUSED:
                await undo()
            raise
        return rows

    async def _fetch(self, partition, rows, fields, padded, pad_value, lease_id="") -> Batch:
        placement = await self._placement(partition)

        async def fetch(shard_id, positions):
            try:
                return positions, await self.shards.get(
                    shard_id, partition, [rows[i] for i in positions], fields, self.shard_wait_s
                )
            except TQError as err:
                # a claim hands out only rows whose fields were committed: a shard without them lost them
                if lease_id and err.code == grpc.StatusCode.NOT_FOUND:
                    raise TQError(
                        grpc.StatusCode.DATA_LOSS,
                        f"rows of lease {lease_id} in {partition} are gone "
                        f"from storage shard {shard_id} ({err.message}); the controller marks them "
                        "lost when the shard comes back: release the lease and claim again",
                    ) from None
                raise

        tables = await asyncio.gather(*(fetch(s, p) for s, p in placement.split(rows)))
        return self._decoded(partition, rows, tables, padded, pad_value, lease_id)

    async def get(self, partition: str, rows: Sequence[int], fields: Sequence[str], padded=False, pad_value=0) -> Batch:
        """Read fields of rows (no claim). Every row must have every field, else NOT_FOUND."""
        rows, fields = list(rows), list(fields)
        checked = await self.controller.acheck_rows(partition, rows, fields)
        await self._placement(partition, checked.partition)
        return await self._fetch(partition, rows, fields, padded, pad_value)

    async def read_claimed(self, claimed: ClaimedRows, fields: Sequence[str], padded=False, pad_value=0) -> Batch:
        """Read fields of rows this client claimed (claim_rows), straight from the shards: a claim returns
        only rows that have the task's fields, so no CheckRows round trip is needed for those."""
        return await self._fetch(claimed.partition, claimed.rows, list(fields), padded, pad_value, claimed.lease_id)

    async def _fields_of(self, task: str) -> list[str]:
        if task not in self._task_fields:
            for t in (await self.controller.alist_tasks()).tasks:
                self._task_fields[t.name] = list(t.required_fields)
        if task not in self._task_fields:
            raise TQError(grpc.StatusCode.NOT_FOUND, f"task {task} is not registered")
        return self._task_fields[task]

    async def claim_rows(
        self,
        partition: str,
        task: str,
        batch_size: int,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        claim_key: str = "",
    ) -> ClaimedRows:
        """Claim rows without reading them."""
        res = await self.controller.aclaim(
            partition,
            task,
            batch_size,
            int(wait_s * 1000),
            int(lease_s * 1000),
            min_rows,
            claim_key,
            timeout=wait_s + _WAIT_SLACK_S,
        )
        return self._claimed(partition, task, res)

    async def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        padded=False,
        pad_value=0,
    ) -> Batch:
        """Claim up to batch_size ready rows (whole groups) and read `fields` (default: the task's
        required fields). An empty batch means nothing was ready by the deadline; `batch.complete`
        says the partition is sealed and fully consumed by this task."""
        for attempt in range(_LOST_RETRIES + 1):
            claimed = await self.claim_rows(partition, task, batch_size, wait_s, lease_s, min_rows)
            if not claimed.rows:
                return Batch(partition=partition, rows=[], columns={}, complete=claimed.complete)
            fields = list(fields) if fields is not None else await self._fields_of(task)
            try:
                batch = await self._fetch(partition, claimed.rows, fields, padded, pad_value, claimed.lease_id)
            except TQError as err:
                await self.release(claimed.lease_id)
                if err.code != grpc.StatusCode.DATA_LOSS or attempt == _LOST_RETRIES:
                    raise
                continue  # the lost groups are out of the queue now: the claim gets the others
            except BaseException:
                await self.release(claimed.lease_id)
                raise
            batch.complete = claimed.complete
            return batch
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def lost_rows(self, partition: str, task: str) -> list[int]:
        """The rows of `partition` lost (their shard came back without them) before `task` consumed them."""
        rows: list[int] = []
        while True:
            page = list((await self.controller.alost_rows(partition, task, rows[-1] + 1 if rows else 0)).rows)
            rows += page
            if len(page) < _LOST_PAGE:
                return rows

    async def ack(self, lease: str | Batch, rows: Sequence[int] = ()) -> int:
        lease_id = lease.lease_id if isinstance(lease, Batch) else lease
        return (await self.controller.aack(lease_id, list(rows))).rows_acked

    async def release(self, lease: str | Batch) -> int:
        lease_id = lease.lease_id if isinstance(lease, Batch) else lease
        return (await self.controller.arelease(lease_id)).rows_released

    async def extend_lease(self, lease: str | Batch, lease_s: float) -> int:
        lease_id = lease.lease_id if isinstance(lease, Batch) else lease
        return (await self.controller.aextend_lease(lease_id, int(lease_s * 1000))).lease_expires_unix_ms


@blocking_methods(AsyncTransferQueue)
class TransferQueue(BlockingFacade):
    """The blocking client: AsyncTransferQueue's operations, run on a private event-loop thread. Safe to
    call from several threads at once."""

    def __init__(
        self,
        controller: str,
        token: str | None = None,
        put_timeout_s: float = 60.0,
        chunk_bytes: int | None = None,
        shard_wait_s: float = 20.0,
    ):
        super().__init__(AsyncTransferQueue(controller, token, put_timeout_s, chunk_bytes, shard_wait_s), "tq-client")
