"""Engines a publisher leaves out of its syncs because they stopped answering.

An engine is registered, and heartbeated, by its rollout, not by itself: an engine process that hangs (stopped
with SIGSTOP, swapped out, wedged in a kernel) stays "alive" at the coordinator, so every sync group would
include it and every sync would fail at its deadline, and the engines that work would get no new weights
either. After a failed sync the publisher asks each engine of that group for `/health`; those that do not
answer are left out of the next groups (`SyncGroupRequest.exclude_nodes`), and at each sync the ones left out
are asked again, in the background (a sync never waits for an engine that does not answer): one that has
answered by the next sync rejoins it, and since every sync sends whole weights, that sync brings it up to
date. `unanswered` asks the same way without a sync: the trainer's check for engines behind the published
version uses it, so an engine that restarted while no step is published (the run waits on that very engine)
rejoins too.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping, Protocol

log = logging.getLogger(__name__)
HEALTH_WAIT_S = 30.0  # the longest a failed sync waits for the /health answers it asks for


class HealthChecked(Protocol):
    base_url: str

    def health(self) -> bool: ...

    def close(self) -> None: ...


class UnresponsiveEngines:
    def __init__(self, pool: ThreadPoolExecutor, client_for: Callable[[str], HealthChecked]):
        self._pool = pool
        self._client_for = client_for
        self._left_out: dict[str, str] = {}  # node id -> the engine's URL
        self._probes: dict[str, Future] = {}  # node id -> its /health answer, asked for at an earlier sync
        self._lock = threading.Lock()  # the publish thread and the trainer's lag check both ask

    def excluded(self) -> list[str]:
        with self._lock:
            return sorted(self._left_out)

    def unanswered(self) -> list[str]:
        """The engines left out that have not answered since: readmit, then what is still left out."""
        self.readmit()
        return self.excluded()

    def after_failure(self, engines: Mapping[str, HealthChecked]) -> None:
        """A sync with these engines (node id -> client) failed: leave out the ones that do not answer now."""
        answers = {node: self._pool.submit(client.health) for node, client in engines.items()}
        for node, answer in answers.items():
            try:
                answered = answer.result(timeout=HEALTH_WAIT_S)
            except Exception:  # no answer in time (or the check failed): as good as no answer
                answered = False
            if not answered:
                with self._lock:
                    self._left_out[node] = engines[node].base_url
                log.warning(
                    "engine unresponsive after a failed sync: left out of the next syncs until it answers",
                    extra={"node_id": node, "engine": engines[node].base_url},
                )

    def readmit(self) -> None:
        """Engines left out whose /health has answered since the last sync rejoin; the others are asked
        (again) in the background, for the next sync."""
        with self._lock:
            self._readmit()

    def _readmit(self) -> None:
        for node, probe in list(self._probes.items()):
            if probe.done():
                del self._probes[node]
                if probe.exception() is None and probe.result():
                    log.info("engine answers again: it rejoins the syncs", extra={"node_id": node})
                    self._left_out.pop(node, None)
        for node, url in self._left_out.items():
            if node not in self._probes:
                self._probes[node] = self._pool.submit(self._probe, url)

    def _probe(self, url: str) -> bool:
        client = self._client_for(url)
        try:
            return client.health()
        finally:
            client.close()
