"""The weight broadcast in memory: the coordinator's record of published versions and both ends of the broadcast
(services/run_state/seams.py: WeightSender, WeightFollower). A role is given the coordinator as its `dcs` (for
the calls roles make on it directly) and its `publisher` / `receiver` factories as the seams."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable

import torch

from services.dcs.client import DCSError
from services.dcs.models import StepRecord, StepsPage, StepsReport
from services.dcs.sync.receiver import NotInGroup


@dataclass
class Published:
    version: int
    tensors: dict[str, torch.Tensor]  # copies, as they were when published
    receiver_roles: list[str]
    announced: bool


class InMemoryCoordinator:
    def __init__(self, broadcast_s: float = 0.0):
        self.broadcast_s = broadcast_s  # how long each publish takes (a real broadcast is not instant)
        self.published: list[Published] = []
        self.cursors: dict[str, int] = {}
        self.publishers: list[FakeWeightPublisher] = []
        self.receivers: list[FakeWeightReceiver] = []
        self.finished: list[str] = []  # the runs the trainer said it finished
        self.step_reports: list[StepsReport] = []  # what the trainer reported of its steps, in order
        self._changed = threading.Condition()

    # ------------------------------------------------------------ what roles call on their `dcs`

    def latest_weights(self, run_id: str) -> Published:
        announced = [p for p in self.published if p.announced]
        if not announced:
            raise DCSError(404, "no weights published")
        return announced[-1]

    def cursors_of(self, run_id: str, role: str) -> int:
        return self.cursors.get(role, 0)

    def topology(self) -> SimpleNamespace:
        return SimpleNamespace(roles={})  # no engine registered: none lags behind the published weights

    def engines(self, run_id: str) -> SimpleNamespace:
        return SimpleNamespace(engines=[])  # the run's engine set: empty, so none lags behind

    def engines_loading(self) -> list[str]:
        """Node ids of the engines a publish reaches (none registered here)."""
        return []

    def finish_run(self, run_id: str) -> None:
        self.finished.append(run_id)

    def report_steps(self, run_id: str, report: StepsReport) -> None:
        self.step_reports.append(report)

    def steps(self, run_id: str, first: int = 0, limit: int = 100) -> StepsPage:
        """What the coordinator holds of the reports: the last progress, each step's last record."""
        records = {r.step: r for report in self.step_reports for r in report.steps}
        last = self.step_reports[-1] if self.step_reports else StepsReport(next_step=0, weight_version=0)
        wanted = range(first, min(last.next_step, first + limit))
        return StepsPage(
            next_step=last.next_step,
            weight_version=last.weight_version,
            steps=[StepRecord(step=s, metrics=records[s].metrics) for s in wanted if s in records],
        )

    def close(self) -> None:
        pass

    # ------------------------------------------------------------ the broadcast

    def publish(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        receiver_roles: Iterable[str],
        announce: bool = True,
    ) -> Published:
        published = Published(version, {n: t.detach().clone() for n, t in named}, list(receiver_roles), announce)
        with self._changed:
            self.published.append(published)
            self._changed.notify_all()
        return published

    def next_after(self, version: int, wait_s: float) -> Published | None:
        """The newest announced version after `version`, waiting (briefly: callers loop) up to wait_s."""

        def newest():
            newer = [p for p in self.published if p.announced and p.version > version]
            return newer[-1] if newer else None

        with self._changed:
            if newest() is None and wait_s > 0:
                self._changed.wait(min(wait_s, 0.05))
            return newest()

    def publisher(self, dcs, node_id: str, master_address: str, **kwargs) -> "FakeWeightPublisher":
        """Made as WeightPublisher is: the trainer's `publisher` seam."""
        self.publishers.append(FakeWeightPublisher(self))
        return self.publishers[-1]

    def receiver(
        self, dcs, node_id: str, role: str, timeout_s: float = 60.0, device: str = "cpu", *, run_id: str
    ) -> "FakeWeightReceiver":
        """Made as WeightReceiver is: a forward role's `receiver` seam."""
        self.receivers.append(FakeWeightReceiver(self, role))
        return self.receivers[-1]


class FakeWeightPublisher:
    def __init__(self, coordinator: InMemoryCoordinator):
        self.coordinator = coordinator
        self.receiver_roles = ["engine", "actor_fwd", "reference"]
        self.resumed = 0
        self.closed = False
        self.prefetched: list[list[str]] = []  # receiver roles of each prefetch_group call

    def publish(self, named, version: int, announce: bool = True) -> SimpleNamespace:
        announced = [p.version for p in self.coordinator.published if p.announced]
        if announce and announced and version <= announced[-1]:  # as the coordinator answers 409
            raise AssertionError(f"version {version} is not newer than the latest published {announced[-1]}")
        time.sleep(self.coordinator.broadcast_s)
        self.coordinator.publish(named, version, self.receiver_roles, announce)
        return SimpleNamespace(
            version=version,
            ok=True,
            seconds={"total": 0.0},
            announced=announce,
            engines=list(self.coordinator.engines_loading()),
        )

    def prefetch_group(self, receiver_roles: list[str]) -> None:
        self.prefetched.append(list(receiver_roles))

    def resume_engines(self) -> int:
        self.resumed += 1
        return 0

    def left_out(self) -> list[str]:
        return []

    def reported(self, timeout_s: float | None = None) -> None:
        """Each publish's engines are in the coordinator's record as it returns (InMemoryCoordinator.publish)."""

    def close(self) -> None:
        self.closed = True


class FakeWeightReceiver:
    def __init__(self, coordinator: InMemoryCoordinator, role: str):
        self.coordinator = coordinator
        self.role = role
        self.version = 0
        self.declared = False
        self.loads: list[int] = []  # versions loaded into the model, in order
        self.closed = False

    def declare(self) -> None:
        self.declared = True
        self.coordinator.cursors.setdefault(self.role, 0)

    def next(self, wait_s: float) -> Published | None:
        return self.coordinator.next_after(self.version, wait_s)

    def receive(self, published: Published, on_bucket=None) -> dict[str, torch.Tensor]:
        if self.role not in published.receiver_roles:
            raise NotInGroup(f"{self.role} is not in the sync group of version {published.version}")
        self.version = published.version
        return {n: t.clone() for n, t in published.tensors.items()}

    def loaded(self, published: Published, load_seconds: float) -> None:
        self.coordinator.cursors[self.role] = published.version
        self.loads.append(published.version)

    def close(self) -> None:
        self.closed = True
