"""Every gRPC method of the controller and the shard, enumerated from the proto descriptor (so a method added
later is covered too), answers UNAUTHENTICATED without the token or with a wrong one, before its request is
even parsed, and a refused call changes nothing; only the standard health service stays open. The token
reaches the processes through their environment, never their command line."""

from __future__ import annotations

import grpc
import pytest

from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.local_stack import LocalTransferQueue, grpc_serving
from services.transferqueue.pb import transferqueue_pb2 as pb

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

TOKEN = "tq-s3cret"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalTransferQueue(shards=1, token=TOKEN, log_dir=str(tmp_path_factory.mktemp("tq-auth"))) as s:
        yield s


def call(channel: grpc.Channel, service, method, metadata) -> grpc.StatusCode:
    """Call `method` with an empty (raw bytes) request; its status code (OK when it answered)."""
    path = f"/{service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            channel.stream_unary(path)(iter([b""]), metadata=metadata, timeout=10)
        elif method.server_streaming:
            list(channel.unary_stream(path)(b"", metadata=metadata, timeout=10))
        else:
            channel.unary_unary(path)(b"", metadata=metadata, timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service_name", ["Controller", "StorageShard"])
def test_every_method_refuses_a_missing_or_wrong_token(stack, service_name):
    service = pb.DESCRIPTOR.services_by_name[service_name]
    address = stack.controller_address if service_name == "Controller" else stack.shard_addresses[0]
    assert len(service.methods) >= 5
    with grpc.insecure_channel(address) as channel:
        for method in service.methods:
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                assert call(channel, service, method, metadata) == grpc.StatusCode.UNAUTHENTICATED, method.name
    assert grpc_serving(address)  # the standard health service stays open for probes


def test_a_refused_call_changes_nothing_and_the_right_token_works(stack):
    with grpc.insecure_channel(stack.controller_address) as channel:
        create = channel.unary_unary("/sluice.transferqueue.v1.Controller/CreatePartition")
        with pytest.raises(grpc.RpcError) as err:
            create(
                pb.CreatePartitionRequest(name="refused").SerializeToString(),
                metadata=(("authorization", "Bearer wrong"),),
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with TransferQueue(stack.controller_address, token=TOKEN) as tq:
        assert "refused" not in [p.name for p in tq.list_partitions()]
        tq.create_partition("accepted")
        assert "accepted" in [p.name for p in tq.list_partitions()]


def test_the_token_is_not_on_any_command_line(stack):
    for proc in [stack.controller, *stack.shards]:
        with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as f:
            assert TOKEN.encode() not in f.read()
