"""The trainer's trained steps, reported to the coordinator (`POST /v1/runs/<run>/steps`), where a follower reads
them (`GET /v1/runs/<run>/steps`: `sluice run`, `sluice status`): a daemon thread of rank 0, off the training
step's path.

The trainer's own records in Redis are the outbox (services/run_state/trainer_progress.py: a step's record and the
progress past it, written in one transaction). The thread reports the progress and the metrics of every recorded
step from the coordinator's progress (what it acknowledged last) up to the trainer's, when told a step was
recorded and every `poll_s` (which also carries a resumed trainer's position). A report that fails is logged (a
warning, again each minute while reports keep failing) and sent again on the next try, with whatever was recorded
since; a restarted trainer starts from the coordinator's progress, so it sends what its predecessor recorded and
never got acknowledged. Waiting for the reports (`recorded(wait_s)`, `close`) is bounded: the run's last step waits
for its report, as the run finishes after it and a follower stops reading then."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from services.dcs.models import MAX_STEPS_PER_REPORT, StepRecord, StepsReport
from services.run_state.trainer_progress import TrainerProgress, read_progress, recorded_metrics

log = logging.getLogger(__name__)

WARN_EVERY_S = 60.0


class StepReports:
    """`dcs`: the coordinator's client (report_steps, steps); `redis`: the trainer's run state (sync client)."""

    def __init__(self, dcs: Any, redis: Any, run_id: str, poll_s: float = 1.0):
        self.dcs, self.redis, self.run_id, self.poll_s = dcs, redis, run_id, poll_s
        self.acknowledged: TrainerProgress | None = None  # the coordinator's progress; asked for on the first pass
        self._passes = 0  # passes started
        self._clean_pass = 0  # the last pass that left nothing unreported
        self._delivered = threading.Condition()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._failing_since: float | None = None
        self._warned_at = 0.0
        self._thread = threading.Thread(target=self._work, name="step-reports", daemon=True)
        self._thread.start()

    def recorded(self, wait_s: float = 0.0) -> bool:
        """A step was recorded: report it now. With wait_s, wait up to that long until the coordinator holds all that
        is recorded; True once it does (and at once without wait_s)."""
        with self._delivered:
            wanted = self._passes + 1  # a pass that starts after this call reads the record
        self._wake.set()
        if wait_s <= 0:
            return True
        with self._delivered:
            return self._delivered.wait_for(lambda: self._clean_pass >= wanted, wait_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Report what is left (waiting up to timeout_s), then stop; what the coordinator did not get is logged as an
        error (it stays in the trainer's records: the run's next trainer reports it)."""
        delivered = self.recorded(wait_s=timeout_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if not delivered:
            log.error(
                "the coordinator did not get the last step reports; followers miss those steps",
                extra={"run_id": self.run_id, "acknowledged": self._acknowledged_step()},
            )

    def _work(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if not self._stop.is_set():
                self._pass()

    def _pass(self) -> None:
        with self._delivered:
            self._passes += 1
            number = self._passes
        try:
            self._report_all()
        except Exception as exc:  # the coordinator or Redis down, restarting: the next pass sends it again
            self._failed(exc)
            return
        if self._failing_since is not None:
            log.info("step reports reach the coordinator again", extra={"run_id": self.run_id})
            self._failing_since = None
        with self._delivered:
            self._clean_pass = number
            self._delivered.notify_all()

    def _report_all(self) -> None:
        """Report from the coordinator's progress up to the trainer's, MAX_STEPS_PER_REPORT steps a report."""
        if self.acknowledged is None:
            page = self.dcs.steps(self.run_id, limit=1)
            self.acknowledged = TrainerProgress(next_step=page.next_step, version=page.weight_version)
        progress = read_progress(self.redis, self.run_id)
        while self.acknowledged != progress:
            first = self.acknowledged.next_step
            last = min(progress.next_step, first + MAX_STEPS_PER_REPORT)  # the report's next_step
            metrics = recorded_metrics(self.redis, self.run_id, range(first, last))
            upto = progress if last == progress.next_step else TrainerProgress(next_step=last, version=progress.version)
            report = StepsReport(
                next_step=upto.next_step,
                weight_version=upto.version,
                steps=[StepRecord(step=s, metrics=m) for s, m in sorted(metrics.items())],
            )
            self.dcs.report_steps(self.run_id, report)
            self.acknowledged = upto

    def _acknowledged_step(self) -> int | None:
        return self.acknowledged.next_step if self.acknowledged is not None else None

    def _failed(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        elif now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        log.warning(
            "reporting trained steps to the coordinator failed; they are sent again with the next report",
            extra={
                "run_id": self.run_id,
                "error": repr(exc),
                "acknowledged": self._acknowledged_step(),
                "failing_s": round(now - self._failing_since, 1),
            },
        )
