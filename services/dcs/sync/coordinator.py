"""What the weight broadcast asks of the coordinator, as Protocols: the publisher and the receiver are given
an object with these calls (the blocking `DCSClient` in a service, a fake in a test), so that the broadcast
imports nothing of the coordinator's app or client."""

from __future__ import annotations

from typing import Any, Protocol

from services.dcs.sync.messages import PublishedWeights, SyncGroup, SyncGroupRequest, SyncReport, WeightMetadata


class PublishingCoordinator(Protocol):
    """The publisher's calls: announce a version, ask for a group, report a sync, read the engines."""

    token: str | None  # the run's token: also what the publisher sends the engines

    def publish_weights(self, run_id: str, metadata: WeightMetadata) -> PublishedWeights: ...

    def sync_group(self, run_id: str, request: SyncGroupRequest) -> SyncGroup: ...

    def report_sync(self, run_id: str, report: SyncReport) -> None: ...

    def topology(self) -> Any: ...  # the coordinator's Topology: its `roles` map a role to its nodes


class ReceivingCoordinator(Protocol):
    """The receiver's calls: hold metadata with a cursor, wait for the next version, report a sync."""

    def set_cursor(self, run_id: str, role: str, version: int) -> Any: ...

    def cursors_of(self, run_id: str, role: str) -> int: ...

    def next_weights(self, run_id: str, after: int, wait_s: float) -> PublishedWeights | None: ...

    def report_sync(self, run_id: str, report: SyncReport) -> None: ...
