"""The process supervisor restarts a failed process, leaves one that finished alone, and gives up on one that
keeps failing (max_restarts within window_s)."""

from __future__ import annotations

import threading
import time

from services.launch.supervision import ProcessSupervisor


class Process:
    def __init__(self, returncode: int | None = None):
        self.returncode = returncode  # None: running

    def alive(self) -> bool:
        return self.returncode is None


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_restarts_failures_leaves_finished_processes_and_gives_up_on_one_that_keeps_failing():
    procs = {"shard": Process(returncode=-9), "rollout": Process(returncode=0), "broken": Process(returncode=2)}
    restarted: list[str] = []

    def restart(name: str) -> None:
        restarted.append(name)
        # the shard comes back healthy; the broken one dies again at once
        procs[name] = Process(returncode=None if name == "shard" else 2)

    supervisor = ProcessSupervisor(lambda: procs, restart, poll_s=0.01, max_restarts=3, window_s=600.0).start()
    try:
        assert wait_until(lambda: "broken" in supervisor.given_up)
        time.sleep(0.1)  # a few more polls: nothing more is restarted
    finally:
        supervisor.stop()
    assert restarted.count("shard") == 1 and procs["shard"].alive()
    assert "rollout" not in restarted  # exit 0: its work is done
    assert restarted.count("broken") == 3 and supervisor.given_up == {"broken"}
    assert [(r.name, r.exit_code) for r in supervisor.restarts if r.name == "shard"] == [("shard", -9)]
    assert all(r.ready is not None and not r.error for r in supervisor.restarts)


def test_a_restart_that_raises_is_recorded_and_tried_again():
    procs = {"engine": Process(returncode=1)}
    attempts: list[int] = []

    def restart(name: str) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("port still in use")
        procs[name] = Process()

    supervisor = ProcessSupervisor(lambda: procs, restart, poll_s=0.01).start()
    try:
        assert wait_until(lambda: procs["engine"].alive())
    finally:
        supervisor.stop()
    assert len(attempts) == 2 and "port still in use" in supervisor.restarts[0].error
    assert supervisor.restarts[1].ready is not None and not supervisor.given_up


def test_stop_need_not_wait_for_a_restart_under_way():
    """A launcher stops the processes right after stop(timeout_s=0) instead of waiting for a restart (an
    engine's can take minutes to be ready); restarting() says one is still on its way."""
    procs = {"engine": Process(returncode=1)}
    release = threading.Event()
    calls: list[str] = []

    def restart(name: str) -> None:
        calls.append(name)
        release.wait(30)  # waiting for the new process to be ready

    supervisor = ProcessSupervisor(lambda: procs, restart, poll_s=0.01).start()
    assert wait_until(lambda: calls == ["engine"])
    started = time.monotonic()
    supervisor.stop(timeout_s=0)
    assert time.monotonic() - started < 5 and supervisor.restarting()
    release.set()
    assert wait_until(lambda: not supervisor.restarting())
    time.sleep(0.05)  # a few polls' time: no restart begins after stop
    assert calls == ["engine"]
