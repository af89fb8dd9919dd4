"""gRPC transport of data-plane clients: channel settings (large messages allowed deliberately) and
the sync/asyncio stub plumbing every client class shares."""

from __future__ import annotations

import asyncio

import grpc

from services.runtime.grpc_auth import auth_metadata
from services.runtime.grpc_tls import TLS_SCHEME, channel_target
from services.transferqueue.errors import TQError

# Data moves in chunks far below this; the limit only guards against a runaway peer.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    # gRPC's default backoff grows to 120 s between connection attempts: a server restarted after a
    # crash would sit unreached for minutes. Attempts every 2 s at most cost nothing.
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class GrpcTransport:
    """Lazily opened sync and asyncio channels to one server; subclasses add the server's RPCs.

    Calls wait for the channel to be ready (up to their deadline) instead of failing at once, so a
    client rides out a server restart."""

    stub_class: type
    default_timeout_s = 30.0

    def __init__(self, address: str, token: str | None = None):
        """`address`: host:port, or tls://host:port for TLS (services/runtime/grpc_tls.py)."""
        self.tls = address.startswith(TLS_SCHEME)
        self.address, self._credentials = channel_target(address)
        self._metadata = auth_metadata(token)
        self._channel = self._stub = None
        self._achannel = self._astub = None
        self._aloop: asyncio.AbstractEventLoop | None = None

    def _sync(self):
        if self._stub is None:
            self._channel = (
                grpc.secure_channel(self.address, self._credentials, options=CHANNEL_OPTIONS)
                if self._credentials
                else grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            )
            self._stub = self.stub_class(self._channel)
        return self._stub

    def _async(self):
        loop = asyncio.get_running_loop()
        if self._astub is None or self._aloop is not loop:  # aio channels belong to one event loop
            self._achannel = (
                grpc.aio.secure_channel(self.address, self._credentials, options=CHANNEL_OPTIONS)
                if self._credentials
                else grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            )
            self._astub = self.stub_class(self._achannel)
            self._aloop = loop
        return self._astub

    def _raw_call(self, asynchronous: bool, kind: str, path: str, serializer, deserializer):
        """A multicallable with our own (de)serializers, for bulk paths that bypass protobuf objects."""
        if asynchronous:
            self._async()
            channel = self._achannel
        else:
            self._sync()
            channel = self._channel
        return getattr(channel, kind)(path, request_serializer=serializer, response_deserializer=deserializer)

    def _invoke(self, method: str, request, timeout):
        try:
            return getattr(self._sync(), method)(
                request, timeout=timeout or self.default_timeout_s, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as err:
            raise TQError.from_rpc(err) from None

    async def _ainvoke(self, method: str, request, timeout):
        try:
            return await getattr(self._async(), method)(
                request, timeout=timeout or self.default_timeout_s, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as err:
            raise TQError.from_rpc(err) from None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

    async def aclose(self) -> None:
        if self._achannel is not None:
            await self._achannel.close()
            self._achannel = self._astub = None
        self.close()
