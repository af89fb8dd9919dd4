"""A service's membership in a run: registered with the coordinator, heartbeating on a thread,
following the run's desired state (pause/resume) at the safe points its loop offers."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from services.dcs.client import DCSClient, DCSError
from services.dcs.models import ENDED, Heartbeat, NodeRegistration

log = logging.getLogger(__name__)


class RunMembership:
    """Register `registration`, heartbeat every `interval_s`, and pause at `safe_point()` while the
    run is paused (acknowledging the pause request so `status` shows it reached a safe point). A run that
    fails or is stopped releases a paused safe point (the role's loop is halted by serve_role)."""

    def __init__(
        self,
        dcs: DCSClient,
        registration: NodeRegistration,
        interval_s: float = 1.0,
        always_at_safe_point: bool = False,
    ):
        """`always_at_safe_point`: a node with no loop of its own to pause (an engine registering itself)
        acknowledges every pause request on the heartbeat that brings it."""
        self.dcs = dcs
        self.always_at_safe_point = always_at_safe_point
        self.removed = False  # taken out of the run (an engine removed through the REST API): no more beats
        self.registration = registration
        self.interval_s = interval_s
        self.replace_previous(dcs, registration)
        self.node_id = dcs.register(registration).node_id
        self.step: int | None = None
        self.weight_version: int | None = None
        self.error: str | None = None
        self._desired = "running"
        self.run_status = "running"  # the run's lifecycle, from the last heartbeat reply
        self._pause_seq = 0
        self._acked_seq = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self.suspended = False  # set while the node is unreachable: the coordinator then sees it dead
        self._beat_once()
        self._thread = threading.Thread(target=self._beat_loop, name=f"heartbeat-{registration.role}", daemon=True)
        self._thread.start()

    @staticmethod
    def replace_previous(dcs: DCSClient, registration: NodeRegistration) -> int:
        """Unregister earlier incarnations of this node (same run, role, rank, host and ports): a process
        that was killed stays 'alive' until its lease lapses, and a weight sync in that window would wait
        for it. Returns how many were removed."""
        removed = 0
        for node in dcs.topology().roles.get(registration.role, []):
            if (node.run_id, node.rank, node.host, node.ports) == (
                registration.run_id,
                registration.rank,
                registration.host,
                registration.ports,
            ):
                dcs.unregister(node.node_id)
                removed += 1
        if removed:
            log.info("replaced an earlier registration of this node", extra={"role": registration.role})
        return removed

    @property
    def ended(self) -> bool:
        """The run failed, finished or was stopped: nothing is left to pause for."""
        return self.run_status in ENDED

    @property
    def paused(self) -> bool:
        return self._desired == "paused" and not self.ended

    def progress(self, step: int | None = None, weight_version: int | None = None) -> None:
        if step is not None:
            self.step = step
        if weight_version is not None:
            self.weight_version = weight_version

    def acknowledge_pause(self) -> None:
        """Report that this node reached a safe point for the current pause request (no blocking)."""
        with self._changed:
            if not self.paused or self._acked_seq == self._pause_seq:
                return
            self._acked_seq = self._pause_seq
        self._beat_once()

    def safe_point(self, stop: threading.Event | None = None, while_paused: Callable[[], None] | None = None) -> None:
        """Return at once while running; while paused, acknowledge and block until resumed (or stop).
        `while_paused` runs repeatedly meanwhile (a weight receiver keeps taking part in syncs the
        trainer started before it paused; it should wait briefly itself)."""
        if not self.paused:
            return
        self.acknowledge_pause()
        log.info("paused at a safe point", extra={"pause_seq": self._pause_seq})
        while self.paused and not (stop and stop.is_set()) and not self._stop.is_set():
            if while_paused is not None:
                while_paused()
            else:
                with self._changed:
                    self._changed.wait(0.2)
        log.info("resumed")

    def _beat_once(self) -> None:
        try:
            reply = self.dcs.heartbeat(
                self.node_id,
                Heartbeat(
                    step=self.step, weight_version=self.weight_version, paused_seq=self._acked_seq, error=self.error
                ),
            )
        except DCSError as exc:
            if exc.status == 404:  # the coordinator forgot us (lease lapsed, or unregistered): register again
                self._register_again()
                return
            raise
        with self._changed:
            self._desired, self._pause_seq, self.run_status = reply.desired_state, reply.pause_seq, reply.status
            if reply.desired_state == "running":
                self._acked_seq = 0
            self._changed.notify_all()
        if self.always_at_safe_point and self.paused and self._acked_seq != self._pause_seq:
            self.acknowledge_pause()

    def _register_again(self) -> None:
        try:
            self.node_id = self.dcs.register(self.registration).node_id
        except DCSError as exc:
            if exc.status != 409:
                raise
            # an engine removed from the run: it stays out until added again (it keeps serving otherwise)
            self.removed = True
            log.warning("removed from the run: no longer registered", extra={"error": str(exc.detail)})
            return
        log.warning("re-registered with the coordinator", extra={"node_id": self.node_id})

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.removed:
                return
            if self.suspended:
                continue
            try:
                self._beat_once()
            except Exception as exc:  # the coordinator may be restarting: keep trying
                log.warning("heartbeat failed", extra={"error": str(exc)})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.removed:
            return
        try:
            self.dcs.unregister(self.node_id)
        except Exception as exc:
            log.warning("could not unregister", extra={"error": str(exc)})
