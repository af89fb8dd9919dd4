"""The fork server (services/runtime/fork_server.py, forked_process.py): a `python -m` child forked from it runs
as a fresh interpreter's would (argv, env, its own session, its log, its exit code, numpy seeded on its own),
is signalled and reaped through the server, is started with Popen when its import-time environment differs, and
is still stopped when the server itself is killed; a server started with --listen forks for other launchers that
connect on its socket (env SLUICE_FORK_SERVER), in their directory and with their PYTHONPATH, and lets each signal
only its own children. The kill -9 of the launcher is in test_child_processes.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from services.runtime.forked_process import UNKNOWN_EXIT, ForkedChild, running
from services.runtime.fork_server_choice import FORK_SERVER_ENV, fork_server_for, start_fork_server
from services.runtime.processes import ChildProcess

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


@pytest.fixture(scope="module")
def listening(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fork-socket") / "server.sock")
    server = start_fork_server(preload=("json", "numpy", "setproctitle"), listen=path)
    assert server is not None and server.proc is not None
    yield server, path
    server.close()


def test_a_launcher_that_connects_forks_in_its_directory_with_its_python_path(listening, tmp_path, monkeypatch):
    owner, path = listening
    monkeypatch.setenv(FORK_SERVER_ENV, path)
    other = fork_server_for()
    assert other is not None and other.proc is None  # connected to the owner's, not started
    (tmp_path / "beside_the_run.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    # as `python -m` started there: the tests package is found through PYTHONPATH only (not the server's directory)
    python_path = os.pathsep.join([str(tmp_path), os.path.dirname(os.path.dirname(os.path.dirname(__file__)))])
    env = {"PYTHONPATH": python_path, "FORK_CHILD_IMPORT": "beside_the_run", "FORK_CHILD_EXIT": "5"}
    proc = ChildProcess("c", [*CHILD, "report"], str(tmp_path / "c.log"), env=env, forker=other)
    assert isinstance(proc.proc, ForkedChild)
    report = _report(proc)
    assert report["ppid"] == owner.proc.pid and report["cwd"] == str(tmp_path)
    assert report["imported"] == str(tmp_path / "beside_the_run.py")
    assert proc.proc.returncode == 5  # its exit reported to the launcher that asked for it
    other.close()
    after = ChildProcess("after", [*CHILD, "report"], str(tmp_path / "a.log"), env=env, forker=owner)
    assert _report(after)["ppid"] == owner.proc.pid  # a connection's end leaves the server serving


def test_a_connection_may_signal_only_its_own_children(listening, tmp_path):
    owner, path = listening
    proc = ChildProcess("sleeper", [*CHILD, "sleep"], str(tmp_path / "s.log"), forker=owner)
    proc.wait_until(lambda: "ready" in proc.log_tail(), 30)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        hello = json.loads(sock.makefile("rb").readline())
        assert hello["ready"] == owner.proc.pid and hello["env"]["OMP_NUM_THREADS"] == "1"
        sock.sendall(json.dumps({"signal": proc.proc.pid, "number": signal.SIGKILL}).encode() + b"\n")
        sock.sendall(b"not json\n")
        time.sleep(0.5)
    assert proc.alive()  # not this connection's child
    assert proc.stop(10) == -signal.SIGTERM


def test_without_a_server_on_the_named_socket_a_launcher_starts_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv(FORK_SERVER_ENV, str(tmp_path / "nobody.sock"))
    server = fork_server_for()
    assert server is not None and server.proc is not None
    server.close()


def test_a_launcher_whose_directory_was_removed_still_forks_in_the_servers(forker, tmp_path, monkeypatch):
    server_directory = os.getcwd()
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    proc = ChildProcess("c", [*CHILD, "report"], str(tmp_path / "g.log"), forker=forker)
    assert isinstance(proc.proc, ForkedChild) and _report(proc)["cwd"] == server_directory
