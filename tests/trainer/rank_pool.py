"""Many cases of the multi-rank trainer tests in one set of spawned ranks.

A case (one layout of one backend, one checkpoint resumed, ...) needs `size` real ranks in their own
processes. Spawning a fresh set per case costs each process its imports (torch, transformers, megatron-core:
seconds each on a 2-core CI machine, far more than the tiny models' steps), so a pool of ranks imports once
and runs every case of a plan in turn: case by case, pool ranks 0..size-1 meet in a fresh process group (rank
0 picks its port when it gets there and leaves it in a file for the others), run the case as a fresh launch
of `size` ranks would, and leave the group again. The plan's order is every rank's order, so the ranks of a
case always reach it together.

A test module makes its pool's results once per test run (`made_once`): under pytest-xdist the first worker
that asks runs the pool and the others wait for its results, so each parametrized case still has its own test
id without a second pool. The tests that do either get TEST_S (pytest-timeout counts fixture set-up) rather
than the suite's per-test 300 s."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pathlib
import sys
import time
from typing import Callable

import pytest

from services.runtime.processes import ChildProcess, free_port
from tests.worker_fork_server import worker_fork_server

POOL_S = 600.0  # a pool's whole run, at most; a test that makes or waits for one allows TEST_S
TEST_S = 900
WAIT_S = POOL_S  # a rank waits this long for the others to reach a case (they may still be on earlier ones)


def made_once(tmp_path_factory, name: str, make: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """The directory `make` filled, made once per test run: under xdist the workers' base temporary directories
    share a parent unique to the run, where the first worker makes it under a lock while the others wait (a
    failure is recorded, so they fail with its message rather than try again)."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with open(f"{directory}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        failed = directory / "FAILED"
        if failed.exists():
            pytest.fail(f"{name} failed in another worker: {failed.read_text()}", pytrace=False)
        if not (directory / "DONE").exists():
            directory.mkdir(parents=True, exist_ok=True)
            try:
                make(directory)
            except BaseException as e:
                failed.write_text(str(e)[-6000:])
                raise
            (directory / "DONE").touch()
    return directory


def run_pool(module: str, plan: list[dict], directory: pathlib.Path, timeout_s: float = POOL_S) -> None:
    """Run `plan` (cases with a unique `name` and a `size`) on max(size) ranks of `python -m module`, each
    given --pool `directory` and its --rank. A rank that fails stops the others at once, and this raises with its
    log; so does a pool still running at `timeout_s`."""
    (directory / "plan.json").write_text(json.dumps(plan))
    ranks = max(case["size"] for case in plan)
    procs = [
        ChildProcess(
            f"pool-{r}",
            [sys.executable, "-m", module, "--pool", str(directory), "--rank", str(r)],
            str(directory / f"rank-{r}.log"),
            forker=worker_fork_server(),
        )
        for r in range(ranks)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.alive() for p in procs):
            bad = [p for p in procs if not p.alive() and p.returncode != 0]
            if bad or time.monotonic() > deadline:
                why = f"exited with {bad[0].returncode}" if bad else f"still running after {timeout_s:.0f}s"
                shown = bad[0] if bad else procs[0]
                raise AssertionError(f"{shown.name} of {module} {why}; its log:\n{shown.log_tail(6000)}")
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        assert codes == [0] * ranks, f"{module}: exit codes {codes}; " + "\n".join(p.log_tail() for p in procs)
    finally:
        for p in procs:
            p.finish(time.monotonic())  # kills what still runs, closes its log


def _master(directory: pathlib.Path, case: dict, rank: int) -> str:
    """The case's rendezvous host:port: rank 0 picks a free port and writes it down, the others wait for it."""
    if case["size"] == 1:
        return ""
    path = directory / f"master-{case['name']}"
    if rank == 0:
        master = f"127.0.0.1:{free_port()}"
        path.with_suffix(".tmp").write_text(master)
        path.with_suffix(".tmp").rename(path)  # whole, or not there
        return master
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 never reached case {case['name']}")
        time.sleep(0.1)
    return path.read_text()


def serve(
    run_case: Callable[[dict, int, str, pathlib.Path], None], warm: Callable[[dict], None] = lambda case: None
) -> None:
    """A pool rank's main: every case of the plan that takes this rank, in order, as run_case(case, rank, master,
    pool directory). `warm` gets the rank's first case before it waits for the others (to import ahead)."""
    p = argparse.ArgumentParser()
    p.add_argument("--pool", type=pathlib.Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    mine = [case for case in json.loads((a.pool / "plan.json").read_text()) if a.rank < case["size"]]
    if mine:
        warm(mine[0])
    for case in mine:
        started = time.monotonic()
        print(f"case {case['name']}: start", flush=True)
        run_case(case, a.rank, _master(a.pool, case, a.rank), a.pool)
        print(f"case {case['name']}: done in {time.monotonic() - started:.1f}s", flush=True)
