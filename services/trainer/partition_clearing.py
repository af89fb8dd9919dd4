"""The trainer's clearing of finished steps' partitions: train_<step> is cleared once every task of the run has
consumed all of it and the step is recorded, on a worker thread, so that the next step need not wait for the
slowest task to ack the last rows (a clear takes a few round trips, and up to clear_wait_s when a task lags)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_state.seams import DataPlane
from services.run_state.step_partitions import StepPartitions
from services.trainer.tasks import expected_tasks


class PartitionClearing:
    def __init__(self, tq: DataPlane, steps: StepPartitions, run: RunConfig, wait_s: float):
        self.tq, self.steps, self.run, self.wait_s = tq, steps, run, wait_s
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="partition-clear")
        self._pending: Future | None = None

    def later(self, step: int | None, halt: threading.Event, recorded: Future | None = None) -> None:
        """Clear train_<step> on the worker thread. A failed clear is raised here at the next call; step None
        waits for the pending clear. `recorded`: the step's publish and record in flight, which the clear waits
        for."""
        if self._pending is not None:
            self._pending.result()  # one clear at a time: a lagging task still holds the trainer back
            self._pending = None
        if step is not None:
            self._pending = self._worker.submit(self.clear, step, halt, recorded)

    def clear(self, step: int, halt: threading.Event, recorded: Future | None = None) -> None:
        """Clear train_<step> once every task of the run has consumed all of it and the step is recorded
        (unless halted first). Not before the record: a trainer killed between the two would restart at
        this step and find its rows gone."""
        partition = partition_name(self.run.name, step)
        deadline = time.monotonic() + self.wait_s
        tasks = expected_tasks(self.run)
        while True:
            info = self.steps.info(step)
            if info is None:
                return
            consumed = {t.task: t.consumed for t in info.tasks}
            if info.sealed and all(consumed.get(t, 0) >= info.rows for t in tasks):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{partition} not consumed by every task in time: {consumed} of {info.rows}")
            if halt.wait(0.05):
                return
        # the record comes even when halted (a publish in flight is finished, within its deadlines, before the
        # trainer stops), and a consumed, recorded partition is cleared then too: a restart need not find it
        if recorded is not None and recorded.exception() is not None:
            return  # not recorded (settle raises it): the rows stay for the step's retry or a restart
        self.tq.clear_partition(partition)

    def close(self) -> None:
        self._worker.shutdown(wait=False)  # a clear in flight stops at its next check of halt
