"""Engines join and leave a running run (every service its own process): after step 3 a second engine is added
with `sluice engines add`; after step 5 a third, started with --dcs-url, registers itself; after step 8 the first
is taken out with `sluice engines remove`; after step 10 the third is killed (its process gone). Every sample is
trained exactly once, each engine that joined got requests only once it served the newest weights, and the engines
left at the end serve the last version."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from services.runtime.processes import ChildProcess, free_port, http_ok, sluice_argv
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


def _sluice_engines(lr: LocalRun, *args: str) -> None:
    done = subprocess.run(
        sluice_argv("engines", *args, "--coordinator", lr.dcs.url), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def _rollout_engines(lr: LocalRun) -> dict[str, dict]:
    status = httpx.get(lr.processes()["rollout"].status_url + "/status", timeout=5).json()
    return {e["url"]: e for e in status.get("engines", [])}


def _engine(lr: LocalRun, name: str, *args: str) -> tuple[ChildProcess, str]:
    port = free_port()
    proc = ChildProcess(
        name,
        sluice_argv(
            "engine",
            "--model",
            lr.run.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--allow-unauthenticated-weight-updates",
            *args,
        ),
        os.path.join(lr.log_dir, f"{name}.log"),
        forker=lr.forker,
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/health"), 120)
    return proc, url


def _served(lr: LocalRun, url: str) -> bool:
    return _rollout_engines(lr).get(url, {}).get("requests", 0) > 0


def _paused(lr: LocalRun, name: str) -> None:
    """Pause the run and wait until every live service of it (its engines too) reached a safe point."""
    with lr.dcs_client() as dcs:
        dcs.pause(name)
        _until(lambda: all(s.state in ("paused", "dead") for s in dcs.status(name).services), 60, "the run paused")


def _resumed(lr: LocalRun, name: str) -> None:
    with lr.dcs_client() as dcs:
        dcs.resume(name)


def test_engines_join_and_leave_a_running_run_and_every_sample_is_trained_once(tmp_path, fork_server):
    model_dir = init_model(str(tmp_path / "tiny"), preset="tiny", arch="qwen2", seed=7)
    run = RunConfig(
        name="elastic",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=8,
        micro_batch_size=4,
        num_steps=48,
        optim={"lr": 1e-4},
        rollout={"max_new_tokens": 16, "reward": "import:tests.e2e.slow_rewards:letters_slowly"},
    )
    extra: list[ChildProcess] = []
    with LocalRun(
        run,
        log_dir=str(tmp_path / "logs"),
        engines=1,
        role_args={"rollout": ["--engine-poll-s", "0.5", "--version-wait-s", "1"]},
        forker=fork_server,
    ) as lr:
        try:
            first = lr.engine_urls[0]
            added_proc, added = _engine(lr, "engine-added")  # up before its turn: a tiny run's steps are fast
            extra.append(added_proc)
            lr.wait_for_step(3, 180)
            _paused(lr, run.name)  # so that the joins land while steps remain
            at_join = lr.progress().version
            _sluice_engines(lr, "add", run.name, added)
            own_proc, own = _engine(lr, "engine-own", "--dcs-url", lr.dcs.url, "--run-id", run.name)
            extra.append(own_proc)
            _until(lambda: {added, own} <= set(_rollout_engines(lr)), 30, "the rollout following both")
            _resumed(lr, run.name)
            _until(lambda: _served(lr, added) and _served(lr, own), 120, "both new engines given requests")

            lr.wait_for_step(8, 180)
            _sluice_engines(lr, "remove", run.name, first)  # while generating: its requests go elsewhere
            _paused(lr, run.name)
            _until(lambda: first not in _rollout_engines(lr), 30, "the removed engine drained")
            os.kill(own_proc.proc.pid, signal.SIGKILL)  # its process gone: its lease lapses, the rollout drains it
            _until(lambda: own not in _rollout_engines(lr), 60, "the killed engine drained")
            engines = _rollout_engines(lr)
            with lr.dcs_client() as dcs:
                listing = dcs.engines(run.name)
            _resumed(lr, run.name)

            lr.wait_for_step(run.num_steps, 300)
            assert list(engines) == [added]
            joined = engines[added]
            # it joined serving older weights and got its first request only once it served the newest
            assert joined["joined_at_version"] >= at_join and joined["first_version"] >= joined["joined_at_version"]
            assert joined["first_version"] > 0  # not the initial weights: those the run had moved past
            assert [e.url for e in listing.engines if e.alive] == [added] and listing.removed == [first]
            assert_run_complete(lr, run, engine_urls=[added])
        finally:
            for proc in extra:
                proc.stop()
