"""The Redis clients every Sluice process makes.

A pool that makes a request wait for a free connection (up to a deadline) instead of failing: redis-py's
default async pool answers the 101st concurrent command with "Too many connections", and a coordinator with
200 clients long-polling at once refused half of them with 503 (tests/dcs/test_dcs_concurrency.py). Commands
are short, so a bounded pool that queues serves any number of waiting clients with a few connections; the
cap keeps one server from exhausting Redis' own client limit.

Commands retried over a Redis restart: redis-py's pooled connections do not retry by default, so after
Redis came back every stale connection in a pool failed one command, and each failure took a role down
(the chaos test, tests/e2e/test_chaos.py). A connection error, a timeout or "loading the dataset" is
retried on a fresh connection for about 2.5 s in all. A retried command may have run once already when
only its reply was lost; every script Sluice runs is safe to repeat or is undone by a lease expiring.

The password: given, or else from this process's environment (services/runtime/redis_password.py: env
SLUICE_REDIS_PASSWORD_FILE or SLUICE_REDIS_PASSWORD), so every service that reads Redis authenticates without
a flag of its own. A password inside the URL wins over both.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry

from services.runtime.redis_password import resolve_redis_password

MAX_CONNECTIONS = 256
WAIT_FOR_CONNECTION_S = 10.0
RETRIES = 5
RETRY_ON = [ConnectionError, TimeoutError, BusyLoadingError]


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=1.0, base=0.1)  # 0.1, 0.2, 0.4, 0.8, 1.0 s


def _password(password: str | None) -> dict[str, str]:
    """redis-py's `password` argument: the one given, else the environment's; none when empty."""
    password = resolve_redis_password() if password is None else password
    return {"password": password} if password else {}


def async_redis(
    url: str, max_connections: int = MAX_CONNECTIONS, wait_s: float = WAIT_FOR_CONNECTION_S, password: str | None = None
) -> aioredis.Redis:
    """A client on a BlockingConnectionPool (decoded responses); `aclose()` closes the pool too.
    `password` None = the environment's (above)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        timeout=wait_s,
        retry=AsyncRetry(_backoff(), RETRIES),
        retry_on_error=list(RETRY_ON),
        **_password(password),
    )
    return aioredis.Redis.from_pool(pool)


def sync_redis(url: str, password: str | None = None) -> redis.Redis:
    """A blocking client (decoded responses) with the same retries and password."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        retry=Retry(_backoff(), RETRIES),
        retry_on_error=list(RETRY_ON),
        **_password(password),
    )
