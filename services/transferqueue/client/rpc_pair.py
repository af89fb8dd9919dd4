"""Define each RPC of a client once and get a blocking method and an asyncio method from it.

    def _claim(self, partition, ...):            # builds (method name, request)
        return "Claim", pb.ClaimRequest(...)
    claim, aclaim = rpc_pair(_claim)

`claim(...)` blocks; `await aclaim(...)` does not. Both accept `timeout=` (seconds) and raise
TQError for any non-OK status.
"""

from __future__ import annotations

import functools


def rpc_pair(build):
    @functools.wraps(build)
    def call(self, *args, timeout: float | None = None, **kwargs):
        method, request = build(self, *args, **kwargs)
        return self._invoke(method, request, timeout)

    @functools.wraps(build)
    async def acall(self, *args, timeout: float | None = None, **kwargs):
        method, request = build(self, *args, **kwargs)
        return await self._ainvoke(method, request, timeout)

    acall.__name__ = "a" + build.__name__.lstrip("_")
    return call, acall
