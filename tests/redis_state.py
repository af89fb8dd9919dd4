"""Redis state as tests compare it: every key with its type and contents."""

from __future__ import annotations

import redis


def redis_digest(client: redis.Redis) -> tuple:
    """Every key with its type and contents: equal digests, equal state. Contents, not DUMP: a big hash's
    DUMP follows its hash table's order, which a mere lookup can change (an incremental rehash step)."""
    keys = sorted(client.keys("*"))
    pipe = client.pipeline()
    for key in keys:
        pipe.type(key)
    kinds = pipe.execute()
    read = {
        b"hash": pipe.hgetall,
        b"set": pipe.smembers,
        b"list": lambda k: pipe.lrange(k, 0, -1),
        b"zset": lambda k: pipe.zrange(k, 0, -1, withscores=True),
        b"string": pipe.get,
    }
    for key, kind in zip(keys, kinds):
        read.get(kind, pipe.dump)(key)
    values = [
        sorted(v.items()) if isinstance(v, dict) else sorted(v) if isinstance(v, set) else v for v in pipe.execute()
    ]
    return tuple(zip(keys, kinds, values))


def changed_keys(before: tuple, after: tuple) -> list[bytes]:
    old, new = {k: v for k, *v in before}, {k: v for k, *v in after}
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
