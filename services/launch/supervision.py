"""Restarting the processes of a run on one machine when they fail, as Compose's `restart: on-failure`
or a Kubernetes controller does: a process that exits non-zero or is killed by a signal is started
again (same port, same data directory); one that exits 0 has finished its work and is left alone.
A process that keeps failing (`max_restarts` within `window_s`) is given up on, so a broken config
fails the run instead of looping. Each restart runs on its own thread: a restarted shard is ready only
once the controller knows it, so restarting one after the other could wait on a dependency that is
itself waiting to be restarted."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

log = logging.getLogger(__name__)


class Supervised(Protocol):
    """A started process (services.runtime.processes.ChildProcess)."""

    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...


@dataclass
class Restart:
    name: str
    exit_code: int | None
    noticed: float  # time.monotonic() when the death was seen
    ready: float | None = None  # when the restarted process was healthy again
    error: str = ""


class ProcessSupervisor:
    """Watches `processes()` (name -> process) on a thread and calls `restart(name)` for each failed one."""

    def __init__(
        self,
        processes: Callable[[], Mapping[str, Supervised]],
        restart: Callable[[str], None],
        poll_s: float = 0.2,
        max_restarts: int = 5,
        window_s: float = 600.0,
    ):
        self.processes = processes
        self.restart = restart
        self.poll_s = poll_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.restarts: list[Restart] = []
        self.given_up: set[str] = set()
        self._restarting: dict[str, threading.Thread] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="process-supervisor", daemon=True)

    def start(self) -> "ProcessSupervisor":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 180.0) -> None:
        """Before the processes are stopped: a stopped process must not be restarted. No restart begins once
        this returns; those under way get `timeout_s` together to end. A launcher that stops its processes
        right after passes 0 and has them stopped meanwhile (`restarting()`, processes.stop_together): a
        restart waiting for its new process to be ready (an engine: up to minutes) ends as soon as that
        process is stopped, where waiting for it first would hold the launcher's exit for as long."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()  # ends within one poll: after this no restart thread is added
        deadline = time.monotonic() + timeout_s
        for thread in list(self._restarting.values()):
            if thread.is_alive() and threading.current_thread() is not thread:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def restarting(self) -> bool:
        """A restart is still under way (its process may not be among processes() yet)."""
        return any(thread.is_alive() for thread in list(self._restarting.values()))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            for name, proc in list(self.processes().items()):
                if self._stop.is_set():
                    return
                busy = self._restarting.get(name)
                if name in self.given_up or (busy is not None and busy.is_alive()) or proc.alive():
                    continue
                code = proc.returncode
                if code == 0:
                    continue  # finished its work
                self._restarting[name] = threading.Thread(
                    target=self._restart, args=(name, code), name=f"restart-{name}", daemon=True
                )
                self._restarting[name].start()

    def _restart(self, name: str, code: int | None) -> None:
        now = time.monotonic()
        recent = [r for r in self.restarts if r.name == name and now - r.noticed < self.window_s]
        if len(recent) >= self.max_restarts:
            self.given_up.add(name)
            log.error(
                "process keeps failing; not restarting it",
                extra={"service": name, "exit_code": code, "restarts": len(recent)},
            )
            return
        record = Restart(name, code, now)
        self.restarts.append(record)
        log.warning("process failed; restarting it", extra={"service": name, "exit_code": code})
        try:
            self.restart(name)
            record.ready = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the next poll sees it dead again and counts the attempt
            record.error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("restart failed", extra={"service": name, "error": record.error})
