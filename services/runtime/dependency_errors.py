"""Which errors of a role's step loop mean "a service it depends on is down for now" (a restart of the
TransferQueue controller or a shard, of the coordinator, an engine or Redis) rather than "this run is
wrong". The first kind must not fail the run: the role exits non-zero and its supervisor starts it again,
and the run goes on from what Redis and the data plane hold (docs/operations.md). Classified by what the
error says (status codes, exception types), so this module needs no client of any of those services."""

from __future__ import annotations

import grpc
import httpx
import redis.exceptions

_GRPC_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_HTTP_STATUSES = {502, 503, 504}
_TYPES = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    httpx.TransportError,
    ConnectionError,
    TimeoutError,
)


def _one(exc: BaseException) -> bool:
    if isinstance(exc, _TYPES):
        return True
    code = getattr(exc, "code", None)
    if callable(code) and isinstance(exc, grpc.RpcError):
        code = code()
    if isinstance(code, grpc.StatusCode):
        return code in _GRPC_CODES
    status = getattr(exc, "status", None)  # the coordinator client's HTTP errors
    return isinstance(status, int) and status in _HTTP_STATUSES


def dependency_unavailable(exc: BaseException | None) -> bool:
    """True when `exc`, or an exception it was raised from, says a dependency could not be reached."""
    seen = 0
    while exc is not None and seen < 16:
        if _one(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False
