"""The storage shards as AsyncTransferQueue reaches them: one ShardClient per shard, dialled at the address the
controller lists for it, and the retries of one shard's part of a put or a read while that shard is away (killed,
then restarted by its supervisor, it replays its journal and is back in seconds)."""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from services.runtime.grpc_tls import with_tls
from services.transferqueue.client.shard_client import ShardClient
from services.transferqueue.errors import TQError


class _Backoff:
    """Retry schedule of one shard's part of a put, jittered exponential until the put's deadline: a full
    shard (RESOURCE_EXHAUSTED "shard full") frees up, and a shard that cannot be reached (UNAVAILABLE:
    killed, then restarted by its supervisor) is back in seconds once it replayed its journal. Sending the
    bytes again is safe: nothing is visible before the commit, and a shard's put overwrites its rows."""

    def __init__(self, shard_id: str, deadline_s: float):
        self.shard_id, self.deadline_s = shard_id, deadline_s
        self.deadline = time.monotonic() + deadline_s
        self.delay = 0.02

    def next_delay(self, err: TQError) -> float:
        # a put over a per-call cap never fits, and no other refusal goes away by itself
        full = err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.message.startswith("shard full")
        if not (full or err.code == grpc.StatusCode.UNAVAILABLE):
            raise err
        if time.monotonic() + self.delay > self.deadline:
            if err.code == grpc.StatusCode.UNAVAILABLE:
                raise TQError(
                    err.code,
                    f"storage shard {self.shard_id} did not answer for {self.deadline_s:g} s "
                    f"(the put's timeout): {err.message}",
                ) from None
            raise err
        delay = self.delay * (0.5 + random.random())
        self.delay = min(self.delay * 2, 1.0)
        return delay


class Shards:
    """The shards' clients by shard id, each dialled the way the controller is (TLS or not)."""

    def __init__(self, token: str | None, tls: bool, chunk_bytes: int | None):
        self.token, self.tls, self.chunk_bytes = token, tls, chunk_bytes
        self._addresses: dict[str, str] = {}
        self._clients: dict[str, ShardClient] = {}

    def client(self, shard_id: str) -> ShardClient:
        client = self._clients.get(shard_id)
        if client is None:
            address = self._addresses.get(shard_id)
            if address is None:
                raise TQError(grpc.StatusCode.UNAVAILABLE, f"storage shard {shard_id} is not registered")
            kwargs = {"chunk_bytes": self.chunk_bytes} if self.chunk_bytes else {}
            client = self._clients[shard_id] = ShardClient(with_tls(address, self.tls), self.token, **kwargs)
        return client

    def knows(self, shard_ids) -> bool:
        """Whether every one of `shard_ids` has an address (else the controller's ListShards is asked: learn)."""
        return all(s in self._addresses for s in shard_ids)

    def learn(self, response) -> None:
        """The addresses of a ListShards answer; a shard that moved is dialled again at its new one."""
        for s in response.shards:
            if self._addresses.get(s.shard_id) != s.address:
                self._addresses[s.shard_id] = s.address
                self._clients.pop(s.shard_id, None)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()

    async def put(
        self, shard_id: str, partition: str, rows: list[int], data, reservation: bytes, deadline_s: float
    ) -> str:
        """One shard's part of a put (its rows' bytes), retried while the shard is full or away for up to
        `deadline_s` (_Backoff); returns the shard's incarnation as its reply says it."""
        backoff = _Backoff(shard_id, deadline_s)
        while True:
            try:
                reply = await self.client(shard_id).aput(
                    partition, rows, data, reservation=reservation, wait_for_ready=False
                )
                return reply.incarnation
            except TQError as err:
                await asyncio.sleep(backoff.next_delay(err))

    async def get(self, shard_id: str, partition: str, rows: list[int], fields, wait_s: float) -> bytearray:
        """One shard's part of a read. A shard that cannot be reached is retried for `wait_s`, then
        UNAVAILABLE naming it: a reader never sits out the two-minute RPC deadline on a dead shard."""
        deadline = time.monotonic() + wait_s
        delay = 0.1
        while True:
            try:
                return await self.client(shard_id).aget(partition, rows, fields, wait_for_ready=False)
            except TQError as err:
                if err.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                if time.monotonic() + delay > deadline:
                    raise TQError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"storage shard {shard_id} did not answer for {wait_s:g} s: {err.message}",
                    ) from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
