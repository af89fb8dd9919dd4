"""Fixtures: a real redis-server and real TransferQueue processes, started by the test suite."""

from __future__ import annotations

import faulthandler
import itertools
import os
import tempfile
import urllib.request

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# a trainer made without an --output-dir writes its run dir here, not under ./runs of the checkout
os.environ.setdefault("SLUICE_TRAINER_OUTPUT_DIR", tempfile.mkdtemp(prefix="sluice-test-runs-"))

import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.runtime.fork_server_choice import fork_stacks_from
from services.runtime.processes import free_port
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.local_stack import LocalTransferQueue
from tests.worker_fork_server import close_worker_fork_server, worker_fork_server

torch.set_num_threads(1)
# every TransferQueue and coordinator a test starts forks from the worker's fork server (none pays its imports)
fork_stacks_from(worker_fork_server)

_names = itertools.count()


def pytest_xdist_make_scheduler(config, log):
    """One test at a time to a free worker; a module marked one_worker whole to one (tests/worker_scheduling.py)."""
    from tests.worker_scheduling import OneWorkerModules

    return OneWorkerModules(config, log)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """The whole run has a deadline (SLUICE_TEST_DEADLINE_S, default 70 min: a full run took 39 min on a slow
    2-core VM; with the install and the 2 min kill margin still under CI's 90): past it, faulthandler's own C
    thread (it needs no GIL, so it fires even when the main thread is wedged in C)
    prints every thread's stack, which names the running test, to the real stderr and exits."""
    deadline_s = float(os.environ.get("SLUICE_TEST_DEADLINE_S", "4200"))
    if deadline_s <= 0:
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture:
        capture.suspend_global_capture(in_=False)
    try:
        config._sluice_stderr = os.fdopen(os.dup(2), "w")  # not the capture file, which dies with us
    finally:
        if capture:
            capture.resume_global_capture()
    faulthandler.dump_traceback_later(deadline_s, exit=True, file=config._sluice_stderr)


@pytest.fixture
def uniq():
    """Fresh partition/task names per test (tests share one stack)."""

    def make(prefix: str = "x") -> str:
        return f"{prefix}{next(_names)}_{os.getpid()}"

    return make


@pytest.fixture(scope="module")
def dcs(tmp_path_factory):
    """A coordinator process on a private Redis, for a module's tests (modules needing flags define their own)."""
    with LocalDCS(log_dir=str(tmp_path_factory.mktemp("dcs"))) as d:
        yield d


@pytest.fixture
def client(dcs):
    """A client of the module's coordinator (`dcs`)."""
    with DCSClient(dcs.url) as c:
        yield c


def pytest_sessionfinish(session):
    close_worker_fork_server()


@pytest.fixture
def exec_stacks():
    """The TransferQueues and coordinators this test starts exec their processes, as a launcher without a fork
    server does."""
    fork_stacks_from(None)
    yield
    fork_stacks_from(worker_fork_server)


@pytest.fixture(scope="session")
def fork_server():
    """The worker's fork server (tests/worker_fork_server.py), for a LocalRun's `forker`."""
    return worker_fork_server()


@pytest.fixture(scope="session")
def tq_stack(tmp_path_factory):
    metrics_port = free_port()
    stack = LocalTransferQueue(
        shards=2, log_dir=str(tmp_path_factory.mktemp("tq")), controller_args=("--metrics-port", str(metrics_port))
    )
    stack.metrics_port = metrics_port
    yield stack
    stack.stop()


@pytest.fixture
def tq(tq_stack):
    client = TransferQueue(tq_stack.controller_address)
    yield client
    client.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="session")
def node_client():
    """The Node.js client package, its npm dependencies installed (tests/node_package.py)."""
    from tests.node_package import install_node_package

    return install_node_package()
