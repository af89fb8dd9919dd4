"""Shared bearer-token authentication for Sluice's gRPC servers and clients."""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc

# Kubernetes gRPC probes cannot send metadata, so health checking stays open.
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def _unauthenticated(method: str):
    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"{method}: missing or wrong bearer token in 'authorization' metadata"
        )

    return deny


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call (health checks excepted) that lacks `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_OPEN_SERVICES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(given, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        deny = _unauthenticated(details.method)
        if handler is None:
            return grpc.unary_unary_rpc_method_handler(deny)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:

            async def deny_stream(request, context):
                await deny(request, context)
                yield  # pragma: no cover - abort raises first

            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
