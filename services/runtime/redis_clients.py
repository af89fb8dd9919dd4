"""The asyncio Redis client every Sluice server makes: a pool that makes a request wait for a free connection
(up to a deadline) instead of failing. redis-py's default async pool answers the 101st concurrent command with
"Too many connections": a coordinator with 200 clients long-polling at once refused half of them with 503
(tests/dcs/test_dcs_concurrency.py). Commands are short, so a bounded pool that queues serves any number of
waiting clients with a few connections; the cap keeps one server from exhausting Redis' own client limit."""

from __future__ import annotations

import redis.asyncio as aioredis

MAX_CONNECTIONS = 256
WAIT_FOR_CONNECTION_S = 10.0


def async_redis(url: str, max_connections: int = MAX_CONNECTIONS,
                wait_s: float = WAIT_FOR_CONNECTION_S) -> aioredis.Redis:
    """A client on a BlockingConnectionPool (decoded responses); `aclose()` closes the pool too."""
    pool = aioredis.BlockingConnectionPool.from_url(url, decode_responses=True, max_connections=max_connections,
                                                    timeout=wait_s)
    return aioredis.Redis.from_pool(pool)
