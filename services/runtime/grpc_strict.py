"""Register a servicer so that undecodable requests get INVALID_ARGUMENT.

grpc's generated `add_*Servicer_to_server` decodes requests before the servicer runs, and a decode
failure surfaces as INTERNAL. Here requests arrive as raw bytes and are parsed in the handler, so a
malformed protobuf is the caller's error, reported as such."""

from __future__ import annotations

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

_BAD = "request is not a valid {}: {}"


def _parse(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except (DecodeError, RuntimeError, ValueError) as exc:
        return exc


def _unary_request(fn, cls):
    async def handler(raw, context):
        request = _parse(cls, raw)
        if isinstance(request, Exception):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _BAD.format(cls.DESCRIPTOR.full_name, request))
        return await fn(request, context)

    return handler


def _unary_request_stream(fn, cls):
    async def handler(raw, context):
        request = _parse(cls, raw)
        if isinstance(request, Exception):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _BAD.format(cls.DESCRIPTOR.full_name, request))
        async for item in fn(request, context):
            yield item

    return handler


def _stream_request(fn, cls):
    async def handler(raw_iterator, context):
        async def parsed():
            async for raw in raw_iterator:
                request = _parse(cls, raw)
                if isinstance(request, Exception):
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, _BAD.format(cls.DESCRIPTOR.full_name, request)
                    )
                yield request

        return await fn(parsed(), context)

    return handler


def add_strict_servicer(
    server: grpc.aio.Server,
    servicer,
    service: ServiceDescriptor,
    raw_requests: frozenset[str] = frozenset(),
    raw_responses: frozenset[str] = frozenset(),
) -> None:
    """raw_requests: methods whose servicer parses the request bytes itself (bulk data paths);
    raw_responses: methods whose servicer returns already serialized messages."""
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        fn = getattr(servicer, method.name)
        serialize = None if method.name in raw_responses else response_cls.SerializeToString
        if method.name in raw_requests:
            factory = {
                (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (False, False): grpc.unary_unary_rpc_method_handler,
            }[(method.client_streaming, method.server_streaming)]
            handlers[method.name] = factory(fn, response_serializer=serialize)
        elif method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                _stream_request(fn, request_cls), response_serializer=serialize
            )
        elif method.server_streaming and not method.client_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _unary_request_stream(fn, request_cls), response_serializer=serialize
            )
        elif not method.client_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary_request(fn, request_cls), response_serializer=serialize
            )
        else:
            raise NotImplementedError(f"{method.full_name}: bidirectional streams are not used")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
