"""Starting children from a process that uses gRPC must never hang, and children must die with their launcher.

gRPC's fork handlers can deadlock `fork()` while gRPC threads run (grpc/grpc#17986, #31885, #37259); a
`preexec_fn` forces CPython onto plain `fork()`. These tests reproduce that situation and check the cure."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from services.runtime import reaper
from services.runtime.processes import ChildProcess, child_env, stop_together
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.errors import TQError
from services.transferqueue.local_stack import LocalTransferQueue

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fork_uses(path: pathlib.Path | str, source: str | None = None) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source if source is not None else pathlib.Path(path).read_text(), str(path))):
        if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
            found.append(f"{path}:{node.value.lineno} preexec_fn")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in ("fork", "forkpty")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            found.append(f"{path}:{node.lineno} os.{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [
                f"{path}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] == "multiprocessing" or n.startswith("torch.multiprocessing")
            ]
    return found


def test_nothing_forks():
    """No preexec_fn, os.fork or multiprocessing (fork by default on Linux) in services/, tests/, benchmarks/:
    start children with services.runtime.processes.ChildProcess. The one fork is the fork server's
    (services/runtime/fork_server.py), a process of its own that loads no gRPC and runs one thread (next test)."""
    files = [p for d in ("services", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    uses = [u for f in files for u in _fork_uses(f)]
    assert [u for u in uses if not u.startswith(f"{ROOT}/services/runtime/fork_server.py:")] == []
    assert len(uses) == 1, uses
    planted = (
        "import os, subprocess\nimport multiprocessing.pool\nos.fork()\nsubprocess.Popen(['x'], preexec_fn=os.setsid)\n"
    )
    assert len(_fork_uses("planted.py", planted)) == 3  # the scanner sees what it looks for


def test_the_fork_servers_preload_starts_no_thread_and_loads_no_grpc():
    """What makes the fork server's fork safe: after its preload, in the environment every child gets
    (child_env: pyarrow's jemalloc without its background thread), the process has one thread and no gRPC."""
    code = (
        "import os, sys, importlib\n"
        "from services.runtime.forked_process import PRELOAD\n"
        "for m in PRELOAD:\n"
        "    importlib.import_module(m)\n"
        "print(len(os.listdir('/proc/self/task')), 'grpc' in sys.modules, 'pyarrow' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False", "True"]


def test_reaper_parses_registrations():
    groups: set[int] = set()
    for line in ["+100\n", "+200", "-100", "+1", "+abc", "junk", "-999", ""]:
        reaper.apply(line, groups)
    assert groups == {200}  # pgid 1 (init) and malformed lines are never registered


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped by init counts as dead
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_children_die_with_a_killed_parent():
    """kill -9 of a launcher takes its children down, even those started from a thread that has exited."""
    parent = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.orphan_parent"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = json.loads(parent.stdout.readline())
        assert all(_alive(p) for p in pids.values())  # survived their starting thread's exit
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids.values()), pids
    finally:
        parent.kill()
        parent.wait()


class _BlockingCalls:
    """Threads that keep blocking gRPC calls open: long-poll claims on an empty partition and streaming
    reads of a multi-chunk row set, retried across restarts."""

    def __init__(self, address: str, rows: list[int]):
        self.address, self.rows = address, rows
        self.stop = threading.Event()
        self.calls = {"claim": 0, "read": 0}
        self.threads = [threading.Thread(target=self._claims, daemon=True) for _ in range(2)]
        self.threads.append(threading.Thread(target=self._reads, daemon=True))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads)

    def _loop(self, kind: str, call) -> None:
        with TransferQueue(self.address) as tq:
            while not self.stop.is_set():
                try:
                    call(tq)
                    self.calls[kind] += 1
                except TQError:
                    time.sleep(0.05)

    def _claims(self) -> None:
        self._loop("claim", lambda tq: tq.claim("empty", "t", 1, wait_s=0.25))

    def _reads(self) -> None:
        self._loop("read", lambda tq: tq.get("full", self.rows, ["x"]))


@pytest.mark.slow
def test_restarting_services_while_grpc_calls_block_never_hangs(tmp_path, exec_stacks):
    """>= 50 service starts and restarts in a process whose other threads hold blocking gRPC calls. A hang
    would come in the start itself (fork-exec while gRPC threads run), so most starts are stopped as soon as
    they return; every tenth shard, and every restarted controller, comes up and serves first."""
    stack = LocalTransferQueue(shards=1, log_dir=str(tmp_path))
    try:
        with TransferQueue(stack.controller_address) as tq:
            tq.create_partition("empty")
            tq.create_partition("full")
            tq.register_task("t", ["x"])
            rows = tq.put("full", {"x": torch.zeros(64, 64 * 1024, dtype=torch.uint8)})  # 4 MiB: chunked reads
        starts = 0
        with _BlockingCalls(stack.controller_address, rows) as blocking:
            for i in range(50):
                # fork-exec while claims and reads are in flight; every tenth then serves before it is stopped
                shard = stack.start_shard(f"extra-{i}", ready=i % 10 == 0)
                stack.shards.remove(shard)
                assert shard.stop() is not None
                starts += 1
                if i % 10 == 9:
                    stack.controller.kill()
                    stack.start_controller()
                    starts += 1
            calls = dict(blocking.calls)
        assert starts >= 55
        assert calls["claim"] > 10 and calls["read"] > 10, calls
    finally:
        stack.stop()


def _shell(tmp_path, name: str, on_term: str) -> ChildProcess:
    """A child that runs `on_term` on SIGTERM, started once its trap is set (its `ready` file exists)."""
    ready = tmp_path / f"{name}.ready"
    proc = ChildProcess(name, ["sh", "-c", f"trap '{on_term}' TERM; touch {ready}; while :; do sleep 0.05; done"])
    proc.wait_until(ready.exists, 30)
    return proc


def test_stop_together_stops_every_process_at_once_with_one_deadline(tmp_path):
    """Two children that each take 1.5 s to exit and one that ignores SIGTERM: stopped together they take the
    deadline (one after the other: 1.5 + 1.5 + the deadline), the slow ones exit cleanly and the stubborn one
    is killed."""
    procs = [
        _shell(tmp_path, "slow-1", "sleep 1.5; exit 0"),
        _shell(tmp_path, "slow-2", "sleep 1.5; exit 0"),
        _shell(tmp_path, "stubborn", ""),
    ]
    started = time.monotonic()
    stop_together(lambda: procs, timeout_s=4.0)
    took = time.monotonic() - started
    assert [p.returncode for p in procs] == [0, 0, -signal.SIGKILL]
    assert 4.0 <= took < 6.5, took


def test_stop_together_also_stops_a_process_a_restart_starts_meanwhile(tmp_path):
    procs = [_shell(tmp_path, "first", "exit 0")]
    restarting = threading.Event()
    restarting.set()

    def restart() -> None:  # a restart under way: its process appears a little later
        time.sleep(0.5)
        procs.append(_shell(tmp_path, "restarted", "exit 0"))
        restarting.clear()

    threading.Thread(target=restart, daemon=True).start()
    stop_together(lambda: list(procs), timeout_s=30.0, starting=restarting.is_set)
    assert len(procs) == 2 and [p.returncode for p in procs] == [0, 0]
