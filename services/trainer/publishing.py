"""The actor trainer's weight versions: numbering and retries, one publish in flight while the trainer waits for
its next step's data, and re-sending to engines that fell behind.

Which version an engine holds is read from one record, the coordinator's (GET /v1/runs/{run_id}/engines): an
engine says it as it registers, and every weight sync that reaches it sets it from the publisher's report of the
engines that loaded it (services/dcs/state.py K:held). Before reading it the trainer waits for the reports of its
own syncs to land (WeightPublisher.reported), so the record includes every sync it made: no settling time."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from services.dcs.sync.publisher import SyncFailed
from services.run_contract.run_config import RunConfig
from services.run_state.seams import WeightSender
from services.runtime.spans import span
from services.trainer.lora import adapter_config, adapter_scaling, trainable

log = logging.getLogger(__name__)
MAX_ENGINE_ERRORS = 5  # resends in a row that an engine answered with an error before the run fails
RESEND_BACKOFF_S = 1.0  # after a failed resend at the run's end, before the next: no tight loop of failing syncs


class WeightsRefused(RuntimeError):
    """A publish no resend can fix: an engine refused the weights themselves (a name or shape its model does not
    have), or the asked sync backend cannot reach the receivers. The run fails with the reason instead of sending
    the same weights again and again."""

    def __init__(self, reason: str | None):
        super().__init__(
            f"the trainer's weights were refused and no resend can change that, so the run cannot go on: {reason}"
        )


class WeightVersions:
    """Publishes the model's weights as numbered versions through `sender`.

    `publish_later` runs a publish on a worker thread and returns at once: the trainer goes on to claim and
    train the next step's rows while the broadcast runs (a publish is a few coordinator and engine round trips
    that need little CPU of the trainer's). What is broadcast is exactly the version trained: a `snapshot`
    publish copies the weights first (a few ms for a small model), so the optimizer may move them meanwhile;
    otherwise the trainer calls `settle_live` before its optimizer touches the weights again. At most one
    publish is in flight: the next one settles it first."""

    def __init__(
        self,
        sender: WeightSender,
        model: torch.nn.Module,
        run: RunConfig,
        dcs,
        run_id: str,
        republish_check_s: float,
        snapshot_max_bytes: int = 2048 << 20,
        source: Callable[[], list] | None = None,
    ):
        self.sender, self.model, self.run, self.dcs, self.run_id = sender, model, run, dcs, run_id
        self.source = source  # the (name, tensor) list to publish, when not the model's live parameters
        sender.adapter_scaling = adapter_scaling(model)  # with LoRA the source yields only the adapter: lora.py
        sender.adapter_config = adapter_config(model)  # what SGLang engines read beside it (adapter_publish.py)
        size = sum(p.numel() * p.element_size() for _, p in trainable(model))
        self.snapshot_fits = size <= snapshot_max_bytes  # a copy of the weights is affordable
        self.republish_check_s = republish_check_s
        self._last_lag_check = time.monotonic()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self._pending: Future | None = None
        self._pending_reads_model = False  # the publish in flight reads the live parameters (no snapshot)
        self.in_flight_version: int | None = None  # the version being published, until settled
        self.last_publish_s = 0.0  # how long the last publish's sync took (tracked with its step)
        self.last_publish_bytes = 0  # what it sent (the adapter alone with LoRA)
        self._engine_errors = 0  # resends in a row that failed with an engine's error answer
        self.skipped: set[int] = set()  # numbers announced by a failed sync: their weights are the next number's

    def receiver_roles(self, version: int) -> list[str]:
        roles = ["engine"]
        if self.run.uses_actor_fwd:
            roles.append("actor_fwd")
        if self.run.uses_reference and self.run.ref_update_interval and version % self.run.ref_update_interval == 0:
            roles.append("reference")
        return roles

    def _weights(self):
        if self.source is not None:
            return self.source()
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def publish(self, version: int, attempts: int = 5, weights: list | None = None) -> int:
        """Publish the current weights as `version`. A failed sync is retried (with backoff, so a dead
        receiver's lease lapses and it leaves the group) under the same number if it failed before the
        coordinator recorded it, else under the next (a recorded number is never reused). Returns the
        version published."""
        for attempt in range(attempts):
            if attempt:  # a receiver that died drops out of the group when its lease lapses
                time.sleep(min(2.0**attempt, 10.0))
            self.sender.receiver_roles = self.receiver_roles(version)
            try:
                result = self.sender.publish(weights if weights is not None else self._weights(), version)
                self.last_publish_s = result.seconds.get("total", 0.0)
                self.last_publish_bytes = getattr(result, "bytes", 0)
                log.info("weights published", extra={"version": version, "seconds": result.seconds})
                return version
            except SyncFailed as exc:
                if exc.result.refused:  # the weights do not fit a receiver's model: the same again cannot help
                    raise WeightsRefused(exc.result.error) from exc
                log.warning("weight sync failed", extra={"version": version, "attempt": attempt, "error": str(exc)})
                if exc.result.announced:  # receivers may hold it as done: the retry needs a new number
                    self.skipped.add(version)
                    version += 1
        raise RuntimeError(f"weight sync failed {attempts} times")

    def lag(self, trained: int, generated: int) -> int:
        """How many weight updates separate the version a sample was generated under from the one it is trained
        at: the difference of the numbers, less the numbers a failed sync skipped in between (a skipped number k
        carried the same weights as k + 1, re-sent under k + 1), so a retried sync does not make samples look
        staler than max_staleness allows (this process's skips: a restarted trainer counts from its restart)."""
        return trained - generated - sum(1 for k in self.skipped if generated <= k < trained)

    def publish_later(
        self, step: int, version: int, then: Callable[[int], None], snapshot: bool = False, weights: list | None = None
    ) -> None:
        """Publish step N's weights on the worker thread, then call `then(version published)` there. With
        `snapshot` the weights are copied now and `then` must not read the model (it may have moved); `weights`,
        a copy already made (a sharded backend's gathered weights), are published as they are."""
        self.settle()
        snapshot = snapshot or weights is not None
        if weights is None and snapshot:
            weights = [(n, t.clone()) for n, t in self._weights()]

        def publish_then() -> None:
            with span("publish", step, version):
                published = self.publish(version, weights=weights)
            then(published)

        self._pending_reads_model = not snapshot
        self.in_flight_version = version
        self._pending = self._worker.submit(publish_then)

    def publish_now(self, step: int, version: int, then: Callable[[int], None]) -> None:
        """Publish step N's weights on this thread, then call `then(version published)`: a streamed source's
        collectives run here, in step with the other ranks of a sharded trainer."""
        self.settle()
        with span("publish", step, version):
            published = self.publish(version)
        then(published)

    def prefetch_group(self, version: int) -> None:
        """As a step starts training: ask for the sync group of `version`, the one it will publish, now, so that
        its publish skips that coordinator round trip (WeightPublisher.prefetch_group)."""
        self.sender.prefetch_group(self.receiver_roles(version))

    @property
    def pending(self) -> Future | None:
        """The publish (and the step's record after it) in flight, if any."""
        return self._pending

    def settle(self) -> None:
        """Wait for the publish in flight, if any; its failure is raised here."""
        pending, self._pending = self._pending, None
        self.in_flight_version, self._pending_reads_model = None, False
        if pending is not None:
            pending.result()

    def training_version(self, version: int, last_iteration: bool) -> int:
        """The version an optimizer step's samples are trained at (the one in flight, if a publish is; else
        `version`), once the weights it moves may change; the step's last iteration also asks for the sync group
        its step will publish in."""
        self.settle_live()  # the last step's weights are published before they change
        version = self.in_flight_version or version
        if last_iteration:
            self.prefetch_group(version + 1)  # asked for now, not on the publish's way to the engines
        return version

    def settle_live(self) -> None:
        """Before the optimizer moves the weights: wait for a publish in flight that reads them."""
        if self._pending_reads_model:
            self.settle()

    def resend_if_lagging(self, version: int) -> None:
        """Every republish_check_s, while no publish is in flight, send `version` again to the engines the
        coordinator records as holding an older one. An engine that restarted (or missed a publish while its
        rollout was down) holds back admission of the very samples the trainer waits for; only a new publish
        brings it up to date."""
        now = time.monotonic()
        if now - self._last_lag_check < self.republish_check_s or (
            self._pending is not None and not self._pending.done()
        ):
            return
        self._last_lag_check = now
        lagging = self._behind(self._recorded_engines(), version)
        if lagging:
            self._send_engines(version, lagging)

    def _recorded_engines(self) -> list:
        """The run's engines with the versions the coordinator records for them (its engine set,
        services/dcs/engine_set.py), read once the reports of this trainer's syncs have reached it; less the ones
        that registered themselves and are gone (a scaled-down pod: nothing brings that registration back). An
        added engine that is down is kept: its rollout keeps it, and a restart brings it back."""
        self.sender.reported()
        return [e for e in self.dcs.engines(self.run_id).engines if e.alive or e.source == "added"]

    def _behind(self, engines: list, version: int) -> list[str]:
        """Node ids of the live engines recorded with an older version than `version`, or with none (registered
        without saying one: only the weights make it known). Not the ones the publisher leaves out as
        unresponsive (a resend now would reach only engines that are current): asking for them has the publisher
        probe them again, and one that answers is behind at a later check."""
        if version < 1:  # nothing published yet: every engine holds the run's initial weights
            return []
        left_out = set(self.sender.left_out())
        return [
            n.node_id
            for n in engines
            if n.alive and (n.weight_version is None or n.weight_version < version) and n.node_id not in left_out
        ]

    def catch_up_engines(
        self, version: int, wait_s: float, stop: threading.Event | None = None, poll_s: float = 0.25
    ) -> bool:
        """After the run's last step is published, before it is recorded (so the rollout still keeps its engines
        registered): every engine of the run serves `version` before the run ends. An engine that restarted
        near the end comes back with its initial weights, and no later publish would reach it (the resend of
        `resend_if_lagging` runs only while the trainer waits for data). Engines recorded with an older version
        get `version` again; an added engine that is down (its registration not alive) is waited for (one that
        registered itself and is gone is not: `_recorded_engines`); both up to `wait_s`. The common end of a
        run, every engine loaded the last publish, returns at once. Returns whether every engine caught up."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                engines = self._recorded_engines()
            except Exception as exc:  # the coordinator restarting: the run's last record must not fail on it
                log.warning("could not read the run's engines", extra={"error": repr(exc)})
                if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                    return False
                time.sleep(poll_s)
                continue
            current = [n for n in engines if n.alive and n.weight_version is not None and n.weight_version >= version]
            if len(current) == len(engines):
                return True
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                log.warning(
                    "the run ends with engines that do not serve its last weights",
                    extra={
                        "version": version,
                        "engines": [(n.node_id, n.alive, n.weight_version) for n in engines if n not in current],
                    },
                )
                return False
            behind = self._behind(engines, version)
            if not behind:
                time.sleep(poll_s)  # an added engine that is down, or one left out: waited for
            elif not self._send_engines(version, behind):
                time.sleep(RESEND_BACKOFF_S)

    def _send_engines(self, version: int, node_ids: list[str]) -> bool:
        """`version` again, to the engines only: no renumbering, so no sample gets staler. Returns whether the
        sync succeeded (its report then records the engines it reached)."""
        log.warning(
            "engines lag behind the published weights; sending them again",
            extra={"engines": node_ids, "version": version},
        )
        self.sender.receiver_roles = ["engine"]
        try:
            self.sender.publish(self._weights(), version, announce=False)
            self._engine_errors = 0
            return True
        except SyncFailed as exc:
            if exc.result.refused:
                raise WeightsRefused(exc.result.error) from exc
            # an engine that is up and answers every resend with an error would be sent the weights for ever
            self._engine_errors = self._engine_errors + 1 if exc.result.engine_error else 0
            if self._engine_errors >= MAX_ENGINE_ERRORS:
                raise RuntimeError(
                    f"resending the weights failed {self._engine_errors} times in a row with an "
                    f"engine's error: {exc.result.error}"
                ) from exc
            log.warning("resending weights to engines failed", extra={"error": repr(exc)})
        except Exception as exc:  # a failed sync, or the coordinator unreachable: tried again at the next check
            log.warning("resending weights to engines failed", extra={"error": repr(exc)})
        return False

    def close(self) -> None:
        """Let a publish in flight finish (a half-sent version would leave engines waiting), then stop."""
        try:
            self.settle()
        except Exception as exc:
            log.warning("the last publish failed", extra={"error": str(exc)})
        self._worker.shutdown(wait=True)
        self.sender.close()
