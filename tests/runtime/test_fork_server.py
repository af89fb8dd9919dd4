"""The fork server (services/runtime/fork_server.py, forked_process.py): a `python -m` child forked from it runs
as a fresh interpreter's would (argv, env, its own session, its log, its exit code, numpy seeded on its own),
is signalled and reaped through the server, is started with Popen when its import-time environment differs, and
is still stopped when the server itself is killed. The kill -9 of the launcher is in test_child_processes.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from services.runtime.forked_process import UNKNOWN_EXIT, ForkedChild, running
from services.runtime.processes import ChildProcess, start_fork_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server runs on Linux only")
CHILD = [sys.executable, "-m", "tests.runtime.fork_child"]


@pytest.fixture(scope="module")
def forker():
    server = start_fork_server(preload=("json", "numpy", "setproctitle"))
    assert server is not None
    yield server
    server.close()


def _report(proc: ChildProcess) -> dict:
    proc.proc.wait(30)
    with open(proc.log_path or "") as f:
        return json.loads(f.read().splitlines()[0])


def test_a_forked_child_runs_as_python_dash_m_would(forker, tmp_path):
    env = {"FORK_CHILD_MARKER": "m1", "FORK_CHILD_EXIT": "3"}
    proc = ChildProcess("child", [*CHILD, "report", "x"], str(tmp_path / "a.log"), env=env, forker=forker)
    assert isinstance(proc.proc, ForkedChild)
    report = _report(proc)
    assert report["argv"] == ["report", "x"] and report["name"] == "__main__"
    assert report["marker"] == "m1" and report["session"] and report["stdin"] == ""
    assert report["cmdline"].split("\0")[0] == f"{sys.executable} -m tests.runtime.fork_child report x"
    assert proc.proc.returncode == 3 and not proc.alive()


def test_each_forked_child_draws_its_own_numpy_numbers(forker, tmp_path):
    draws = set()
    for i in range(2):
        proc = ChildProcess(f"c{i}", [*CHILD, "report"], str(tmp_path / f"{i}.log"), forker=forker)
        draws.add(_report(proc)["draw"])
    assert len(draws) == 2


def test_an_exception_exits_1_with_its_traceback_in_the_log(forker, tmp_path):
    proc = ChildProcess("raiser", [*CHILD, "raise"], str(tmp_path / "r.log"), forker=forker)
    assert proc.proc.wait(30) == 1
    assert "fork_child raised on purpose" in proc.log_tail()


def test_sigterm_reaches_the_child_and_its_exit_is_reported(forker, tmp_path):
    proc = ChildProcess("sleeper", [*CHILD, "sleep"], str(tmp_path / "s.log"), forker=forker)
    proc.wait_until(lambda: "ready" in proc.log_tail(), 30)
    assert proc.stop(10) == -signal.SIGTERM
    proc.terminate()  # after its exit: nothing is sent anywhere
    assert not proc.alive()


def test_a_child_whose_import_time_env_differs_is_not_forked(forker, tmp_path):
    proc = ChildProcess(
        "other", [*CHILD, "report"], str(tmp_path / "o.log"), env={"OMP_NUM_THREADS": "2"}, forker=forker
    )
    assert isinstance(proc.proc, subprocess.Popen)
    assert _report(proc)["argv"] == ["report"]
    not_module = ChildProcess("sh", ["sh", "-c", "exit 4"], forker=forker)
    assert isinstance(not_module.proc, subprocess.Popen) and not_module.proc.wait(10) == 4


def test_a_request_the_server_refuses_fails_that_child_only(forker, tmp_path):
    bad = forker.spawn("not a module", [], {}, None)
    assert bad.wait(30) == UNKNOWN_EXIT and "module" in (bad.error or "")
    with pytest.raises(RuntimeError, match="did not start"):
        _ = bad.pid
    good = ChildProcess("after", [*CHILD, "report"], str(tmp_path / "g.log"), forker=forker)
    assert _report(good)["name"] == "__main__"


def test_children_outlive_a_killed_server_and_are_still_stopped(tmp_path):
    server = start_fork_server(preload=("json",))
    assert server is not None
    proc = ChildProcess("orphan", [*CHILD, "sleep"], str(tmp_path / "k.log"), forker=server)
    proc.wait_until(lambda: "ready" in proc.log_tail(), 30)
    pid = proc.proc.pid
    server.proc.kill()
    server.proc.wait(10)
    deadline = time.monotonic() + 10
    while not server.gone and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.gone and proc.alive()  # its parent is gone, it is not
    assert not server.can_fork(os.environ)  # a restart after this starts with Popen
    assert proc.stop(10) == UNKNOWN_EXIT
    assert not running(pid)
