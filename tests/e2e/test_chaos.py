"""Chaos: one fully-async run, every service its own process (redis-server with an append-only file, the
TransferQueue controller and a journaled shard, the coordinator, an engine, rollout, actor_fwd, reference,
advantage and trainer). Each service is killed with kill -9 once, in a random order at a random moment,
and the run's supervisor starts it again. The run finishes, every sample is trained exactly once and
weight versions never go back (the coordinator's, polled all through, and the engine's within each of its
lives). The table it prints (pytest -s), with the samples lost counted against the fault before them, is the
one in docs/operations.md.

SLUICE_CHAOS_SEED=<n> replays one order and timing."""

from __future__ import annotations

import os
import random
import threading
import time

import httpx
import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from services.run_state import run_key
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAULTS = ["rollout", "trainer", "actor_fwd", "reference", "advantage", "tq-controller", "tq-shard shard-0", "dcs",
          "engine-0", "redis"]
STEPS_PER_FAULT = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def _retry(call, timeout_s: float = 120.0):
    """`call()`, retried while a service (Redis itself, during its fault) is coming back."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except Exception:  # noqa: BLE001
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Ledger:
    """Samples the engines completed (summed over engine lifetimes) and samples the rollout wrote."""

    def __init__(self, lr: LocalRun):
        self.lr = lr
        self.dead_engines_completed = 0.0

    def engine_completed(self) -> float:
        text = httpx.get(self.lr.engine_urls[0] + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("sluice_engine_requests_total{") and 'finish="abort"' not in line)

    def completed(self) -> float:
        return self.dead_engines_completed + _retry(self.engine_completed)

    def written(self) -> int:
        def read():
            with self.lr.redis_client() as r:
                frontier = int(r.get(run_key(self.lr.run.name, "rollout", "frontier")) or 0)
                return frontier + r.scard(run_key(self.lr.run.name, "rollout", "written"))
        return _retry(read) * self.lr.run.n_samples_per_prompt

    def regenerated(self) -> float:
        return self.completed() - self.written()


class VersionWatch(threading.Thread):
    """Polls, all through the faults, the version the coordinator last accepted and the one the engine serves
    (with the engine's pid: a restarted engine starts from the weights it was started with and a full sync
    brings it up to date): neither may ever go back, across every kill and restart of the coordinator, Redis
    or the engine."""

    def __init__(self, lr: LocalRun, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.lr, self.every_s = lr, every_s
        self.published: list[int] = []
        self.served: list[tuple[int, int]] = []  # (engine pid, version)
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2) as http:
            while not self.halt.wait(self.every_s):
                self._read(http)

    def _read(self, http: httpx.Client) -> None:
        lr = self.lr
        try:  # a service being killed or restarted does not answer: that poll is skipped
            r = http.get(f"{lr.dcs.url}/v1/runs/{lr.run.name}/weights/latest")
            if r.status_code == 200:
                self.published.append(int(r.json()["version"]))
            pid = lr.processes()["engine-0"].proc.pid
            served = http.get(lr.engine_urls[0] + "/weight_version").json()["weight_version"]
            if served.isdigit():
                self.served.append((pid, int(served)))
        except (httpx.HTTPError, ValueError, KeyError):
            pass

    def assert_never_back(self) -> None:
        assert self.published and self.published == sorted(self.published), self.published
        by_engine: dict[int, list[int]] = {}
        for pid, version in self.served:
            by_engine.setdefault(pid, []).append(version)
        assert len(by_engine) >= 2, "the engine's versions were not seen before and after its restart"
        for versions in by_engine.values():
            assert versions == sorted(versions), versions


def _lost_by_fault(run: RunConfig, steps: dict[int, dict], rows: list[dict]) -> dict[str, int]:
    """Samples never trained, each counted against the last fault injected at or before its step."""
    trained = {i for rec in steps.values() for i in rec["samples"]}
    lost = {r["fault"]: 0 for r in rows}
    for p in range(run.num_steps * run.rollout_batch_size):
        for k in range(run.group_rows):
            if f"{p}:{k}" not in trained:
                step = p // run.rollout_batch_size
                at = [r["fault"] for r in rows if r["at_step"] <= step] or [rows[0]["fault"]]
                lost[at[-1]] += 1
    return lost


def _back(lr: LocalRun, fault: str, killed: float) -> float:
    """When the killed process was running again (restarted by the supervisor)."""
    while True:
        ready = [r.ready for r in lr.supervisor.restarts if r.name == fault and r.noticed >= killed and r.ready]
        if ready:
            return ready[0]
        assert time.monotonic() - killed < 300, f"{fault} not restarted within 300 s"
        time.sleep(0.1)


def _inject(lr: LocalRun, ledger: Ledger, fault: str) -> dict:
    """Kill `fault`; once it is back, wait for the trainer to finish a step. What it cost: the time from
    the kill to that step, samples generated again, other services that went down with it."""
    at_step = _retry(lr.progress).next_step
    regenerated = ledger.regenerated()
    restarts_before = len(lr.supervisor.restarts)
    if fault.startswith("engine-"):
        ledger.dead_engines_completed += ledger.engine_completed()
    killed = time.monotonic()
    lr.processes()[fault].kill()
    _back(lr, fault, killed)
    step = _retry(lr.progress).next_step
    while _retry(lr.progress).next_step <= step and step < lr.run.num_steps:
        assert time.monotonic() - killed < 300, f"no step finished within 300 s of killing {fault}"
        time.sleep(0.2)
    others = sorted({r.name for r in lr.supervisor.restarts[restarts_before:] if r.name != fault})
    return {"fault": fault, "at_step": at_step, "recover_s": round(time.monotonic() - killed, 1),
            "regenerated": max(0, round(ledger.regenerated() - regenerated)), "also_restarted": others}


def _table(rows: list[dict]) -> str:
    lines = ["| fault (kill -9) | at step | time to recover (s) | samples regenerated | samples lost | also restarted |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['fault']} | {r['at_step']} | {r['recover_s']} | {r['regenerated']} | {r['lost']} | "
              f"{', '.join(r['also_restarted']) or '-'} |" for r in rows]
    return "\n".join(lines)


def test_every_service_killed_once_and_the_run_trains_every_sample_once(model_dir, tmp_path):
    seed = int(os.environ.get("SLUICE_CHAOS_SEED", "0")) or random.randrange(1, 1 << 30)
    rng = random.Random(seed)
    order = rng.sample(FAULTS, len(FAULTS))
    run = RunConfig(name="chaos", model=model_dir, max_staleness=1, n_samples_per_prompt=4, rollout_batch_size=2,
                    global_batch_size=4, micro_batch_size=4, num_steps=5 * len(FAULTS), checkpoint_interval=1,
                    ref_update_interval=2, algorithm={"decoupled": True, "kl_coef": 0.01},
                    rollout={"max_new_tokens": 16}, optim={"lr": 1e-4})
    with LocalRun(run, log_dir=str(tmp_path / "logs"), checkpoint_dir=str(tmp_path / "ckpt"),
                  redis_data_dir=str(tmp_path / "redis"), engine_args=("--weight-sync-timeout-s", "10"),
                  role_args={"actor_fwd": ["--lease-s", "3", "--weight-sync-timeout-s", "10"],
                             "reference": ["--lease-s", "3", "--weight-sync-timeout-s", "10"],
                             "advantage": ["--lease-s", "3"],
                             "trainer": ["--weight-sync-timeout-s", "10", "--republish-check-s", "2"]}) as lr:
        supervisor = lr.supervise()
        ledger = Ledger(lr)
        versions = VersionWatch(lr)
        versions.start()
        rows = []
        for i, fault in enumerate(order):  # one every STEPS_PER_FAULT steps (or once the last recovered)
            while _retry(lr.progress).next_step < 1 + STEPS_PER_FAULT * i:
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 1.0))  # a random moment within the step
            assert _retry(lr.progress).next_step < run.num_steps - 1, f"run ended before {fault}: raise num_steps"
            rows.append(_inject(lr, ledger, fault))
            print(f"chaos seed {seed}: {rows[-1]}", flush=True)
        lr.wait_for_step(run.num_steps, 600)
        versions.halt.set()
        versions.join()
        lost = _lost_by_fault(run, lr.trained_steps(), rows)
        for row in rows:
            row["lost"] = lost[row["fault"]]
        print(f"\nchaos seed {seed}\n{_table(rows)}\ntotal regenerated: {round(ledger.regenerated())}")
        assert sum(lost.values()) == 0
        assert_run_complete(lr, run, staleness_bounded=False)  # exactly once; recorded versions only go up
        versions.assert_never_back()
        assert supervisor.given_up == set()
        assert {r.name for r in supervisor.restarts} >= set(FAULTS)
