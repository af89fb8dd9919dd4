"""Servicer plumbing shared by the controller and the storage shard: error mapping and RPC metrics."""

from __future__ import annotations

import functools
import logging
import time

import grpc
from prometheus_client import Counter, Histogram
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.transferqueue.errors import TQError

log = logging.getLogger(__name__)

RPC_TOTAL = Counter("sluice_tq_rpc_total", "TransferQueue RPCs handled", ["server", "method", "code"])
RPC_SECONDS = Histogram("sluice_tq_rpc_seconds", "TransferQueue RPC handling time", ["server", "method"],
                        buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))


def unary_handler(server: str):
    """Wrap an async unary servicer method: TQError -> its status code; anything else -> INTERNAL, logged."""

    def wrap(fn):
        method = fn.__name__

        @functools.wraps(fn)
        async def handler(self, request, context: grpc.aio.ServicerContext):
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return await fn(self, request, context)
            except TQError as exc:
                code = exc.code
                await context.abort(exc.code, exc.message)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                code = grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"{method}: metadata store unreachable: {exc}")
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except Exception as exc:  # a bug or an unreachable dependency: say so, keep serving
                code = grpc.StatusCode.INTERNAL
                log.exception("rpc failed", extra={"method": method})
                await context.abort(grpc.StatusCode.INTERNAL, f"{method}: {type(exc).__name__}: {exc}")
            finally:
                RPC_TOTAL.labels(server, method, code.name).inc()
                RPC_SECONDS.labels(server, method).observe(time.perf_counter() - start)

        return handler

    return wrap
