"""Servicer plumbing shared by the controller and the storage shard: error mapping and RPC metrics."""

from __future__ import annotations

import contextlib
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
RPC_SECONDS = Histogram(
    "sluice_tq_rpc_seconds",
    "TransferQueue RPC handling time",
    ["server", "method"],
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)


@contextlib.asynccontextmanager
async def rpc_scope(server: str, method: str, context: grpc.aio.ServicerContext):
    """Around one RPC, unary or streaming: TQError -> its status code, Redis down -> UNAVAILABLE,
    anything else -> INTERNAL (logged; the server keeps serving); counted and timed either way."""
    start = time.perf_counter()
    code = grpc.StatusCode.OK
    try:
        yield
    except TQError as exc:
        code = exc.code
        await context.abort(exc.code, exc.message)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        code = grpc.StatusCode.UNAVAILABLE
        await context.abort(code, f"{method}: metadata store unreachable: {exc}")
    except grpc.aio.AbortError:
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    except Exception as exc:
        code = grpc.StatusCode.INTERNAL
        log.exception("rpc failed", extra={"method": method})
        await context.abort(code, f"{method}: {type(exc).__name__}: {exc}")
    finally:
        RPC_TOTAL.labels(server, method, code.name).inc()
        RPC_SECONDS.labels(server, method).observe(time.perf_counter() - start)


def unary_handler(server: str):
    """Wrap an async unary servicer method in rpc_scope."""

    def wrap(fn):
        @functools.wraps(fn)
        async def handler(self, request, context: grpc.aio.ServicerContext):
            async with rpc_scope(server, fn.__name__, context):
                return await fn(self, request, context)

        return handler

    return wrap
