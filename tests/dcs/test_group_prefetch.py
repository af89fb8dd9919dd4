"""A publish takes the sync group prefetched while the step trained (one coordinator round trip fewer on its
way to the receivers), unless it is for other roles, too old, or a sync failed since."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from services.dcs.models import GroupMember, SyncGroup, SyncReport
from services.dcs.sync import bucket_packing
from services.dcs.sync import publisher as publisher_module
from services.dcs.sync.publisher import WeightPublisher


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Coordinator:
    """The calls a publish makes to the coordinator, counted; the group has only the source (no receivers)."""

    def __init__(self):
        self.token = ""
        self.group_requests: list = []
        self.published: list[int] = []
        self.reports: list[SyncReport] = []
        self.port = _port()

    def sync_group(self, run_id: str, request):
        self.group_requests.append(request)
        return SyncGroup(
            name="g-1",
            generation=1,
            master_address="127.0.0.1",
            master_port=self.port,
            world_size=1,
            backend="gloo",
            members=[GroupMember(node_id="trainer-0", role="trainer", rank=0)],
        )

    def publish_weights(self, run_id: str, metadata) -> None:
        self.published.append(metadata.version)

    def report_sync(self, run_id: str, report) -> None:
        self.reports.append(SyncReport.model_validate(report.model_dump()))  # as the coordinator would


@pytest.fixture
def sender():
    dcs = Coordinator()
    publisher = WeightPublisher(dcs, "trainer-0", "127.0.0.1", timeout_s=20, receiver_roles=["engine"], run_id="r")
    yield publisher, dcs
    publisher.close()


WEIGHTS = [("w", torch.ones(4))]


def test_a_publish_takes_the_prefetched_group(sender):
    publisher, dcs = sender
    publisher.prefetch_group(["engine"])
    assert publisher.publish(WEIGHTS, 1).ok
    assert len(dcs.group_requests) == 1 and dcs.published == [1]
    assert publisher.publish(WEIGHTS, 2).ok  # nothing prefetched: it asks itself
    assert len(dcs.group_requests) == 2 and dcs.published == [1, 2]


def test_a_prefetch_for_other_roles_or_too_old_is_asked_again(sender, monkeypatch):
    publisher, dcs = sender
    publisher.prefetch_group(["engine", "reference"])  # the next version goes to the engines only
    assert publisher.publish(WEIGHTS, 1).ok
    assert [r.receiver_roles for r in dcs.group_requests] == [["engine", "reference"], ["engine"]]
    monkeypatch.setattr(publisher_module, "GROUP_MAX_AGE_S", 0.0)
    publisher.prefetch_group(["engine"])
    assert publisher.publish(WEIGHTS, 2).ok
    assert len(dcs.group_requests) == 4  # the stale answer was not used


def test_after_a_failed_sync_the_prefetch_is_not_used(sender):
    publisher, dcs = sender
    publisher.prefetch_group(["engine"])
    publisher._failed = True  # the last sync failed: the next asks for a new group
    assert publisher.publish(WEIGHTS, 1).ok
    assert len(dcs.group_requests) == 2 and dcs.group_requests[-1].new_group


def test_overlapped_packing_still_reports_phases_the_coordinator_accepts(sender, monkeypatch):
    """Bucket k+1 is packed while bucket k is broadcast, so pack + broadcast can exceed the wall time; a phase
    derived by subtraction once went negative and the coordinator refused every report (422)."""
    publisher, dcs = sender
    publisher.bucket_bytes = 16  # one 4-float tensor per bucket
    real_pack = bucket_packing.pack

    def slow_pack(*args, **kwargs):
        time.sleep(0.05)
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(bucket_packing, "pack", slow_pack)
    publisher.prefetch_group(["engine"])
    assert publisher.publish([("a", torch.ones(4))], 1).ok  # opens the group
    real_broadcast = publisher._group.broadcast
    monkeypatch.setattr(publisher._group, "broadcast", lambda *a: (time.sleep(0.05), real_broadcast(*a))[1])
    assert publisher.publish([(name, torch.ones(4)) for name in "abcd"], 2).ok
    publisher.close()  # the queued reports are sent
    assert [r.version for r in dcs.reports] == [1, 2]
    assert all(seconds >= 0 for r in dcs.reports for seconds in r.seconds.values())


class EchoingCoordinator(Coordinator):
    """Answers with the backend asked for, and one actor_fwd receiver on `gpu`."""

    def __init__(self, gpu: str):
        super().__init__()
        self.gpu = gpu

    def sync_group(self, run_id: str, request):
        self.group_requests.append(request)
        return SyncGroup(
            name=f"g-{request.backend}",
            generation=1,
            master_address="127.0.0.1",
            master_port=self.port,
            world_size=2,
            backend=request.backend,
            members=[
                GroupMember(node_id="trainer-0", role="trainer", rank=0),
                GroupMember(node_id="fwd-0", role="actor_fwd", rank=1, gpu=self.gpu),
            ],
        )


def test_auto_asks_again_for_the_backend_its_members_call_for_and_an_impossible_one_fails_for_good():
    from services.dcs.sync.publisher import SyncFailed, UnusableBackend

    dcs = EchoingCoordinator(gpu="GPU-1")
    publisher = WeightPublisher(
        dcs, "trainer-0", "127.0.0.1", timeout_s=20, receiver_roles=["actor_fwd"], run_id="r", backend="auto"
    )
    publisher._trainer_gpu = "GPU-0"  # as on a GPU trainer (this machine has none)
    try:
        spec = publisher._resolved_group()
        assert spec.backend == "nccl" and [r.backend for r in dcs.group_requests] == ["gloo", "nccl"]
        assert publisher._resolved_group().backend == "nccl" and len(dcs.group_requests) == 3  # remembered
        dcs.gpu = "GPU-0"  # the receiver moved onto the trainer's GPU: NCCL would refuse two ranks on one device
        assert publisher._resolved_group().backend == "gloo"
        publisher.backend = "ipc"  # a forward role takes no IPC handles
        with pytest.raises(UnusableBackend, match="not: actor_fwd"):
            publisher._resolved_group()
        with pytest.raises(SyncFailed) as failed:
            publisher.publish(WEIGHTS, 1)
        assert failed.value.result.refused and not failed.value.result.announced
    finally:
        publisher.close()
