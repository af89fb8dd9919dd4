"""Put reservations: the controller's signed permission to write rows of a partition to the shards.

`PreparePut` returns a reservation for the rows it allocated (or checked); the client sends it in
every shard `PutHeader`, and a shard stores a put only if the reservation is genuine, unexpired, for
that partition and covers every row of the put. So a shard holds bytes only for rows the controller
handed out, and a put that bypasses the controller is refused before any byte is parsed.

    reservation = expiry_ms (8 bytes, big-endian) || lo (8) || hi (8) || HMAC-SHA256(key, msg) (32)
    msg         = b"sluice-tq-put\\0" || partition (UTF-8) || b"\\0" || expiry_ms || lo || hi
    valid       <=> HMAC matches, now_ms <= expiry_ms, lo <= row <= hi for every row of the put

The key is 32 random bytes kept in Redis (`K:reservation_key`, created once), so every controller
replica signs alike; shards learn it from their (authenticated) `RegisterShard` reply. One HMAC per
PreparePut and per shard Put, a few microseconds, instead of a controller round trip per shard Put.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

import grpc

from services.transferqueue.errors import TQError

_PREFIX = b"sluice-tq-put\0"
_HEAD = struct.Struct(">qqq")
SIZE = _HEAD.size + 32


def _mac(key: bytes, partition: str, head: bytes) -> bytes:
    return hmac.new(key, _PREFIX + partition.encode() + b"\0" + head, hashlib.sha256).digest()


def issue(key: bytes, partition: str, rows: list[int], ttl_s: float) -> bytes:
    """A reservation for rows min(rows)..max(rows) of `partition`, valid for ttl_s."""
    expiry = int(time.time() * 1000 + ttl_s * 1000)
    head = _HEAD.pack(expiry, min(rows), max(rows))
    return head + _mac(key, partition, head)


def _denied(message: str) -> TQError:
    return TQError(grpc.StatusCode.PERMISSION_DENIED, message)


def verify(keys: list[bytes], partition: str, row_min: int, row_max: int, reservation: bytes) -> None:
    """Raise unless `reservation` was issued (under one of `keys`) for these rows of `partition` and is live."""
    if not keys:
        raise TQError(grpc.StatusCode.UNAVAILABLE, "shard has not registered with the controller yet")
    if not reservation:
        raise _denied("put carries no reservation: write rows the controller's PreparePut handed out")
    if len(reservation) != SIZE:
        raise _denied(f"put reservation is {len(reservation)} bytes, not {SIZE}: not issued by the controller")
    head, mac = reservation[: _HEAD.size], reservation[_HEAD.size :]
    if not any(hmac.compare_digest(mac, _mac(k, partition, head)) for k in keys):
        raise _denied(f"put reservation was not issued by the controller for partition {partition}")
    expiry, lo, hi = _HEAD.unpack(head)
    now = int(time.time() * 1000)
    if now > expiry:
        raise TQError(
            grpc.StatusCode.FAILED_PRECONDITION, f"put reservation expired {now - expiry} ms ago: prepare the put again"
        )
    if row_min < lo or row_max > hi:
        raise TQError(
            grpc.StatusCode.FAILED_PRECONDITION, f"put rows {row_min}..{row_max} are outside its reservation {lo}..{hi}"
        )
