"""Chaos: one fully-async run on the stack `sluice run` starts, with its defaults (services/front_door/
stack_start.py start_stack: a generated token, redis-server with an append-only file under the run dir fsynced
every second and a generated password, the TransferQueue controller and a journaled shard, the coordinator,
an engine, rollout, actor_fwd, reference, advantage and trainer, each its own process; only the roles'
leases and timeouts are shortened, through the run file's stack.role_flags, so that recovery takes seconds).
Each service is killed with kill -9 once, in a random order at a random moment, and the run's supervisor
starts it again. The run finishes, every sample is trained exactly once and
weight versions never go back (the coordinator's, polled all through, and the engine's within each of its
lives). The table it prints (pytest -s), with the samples lost counted against the fault before them, is the
one in docs/operations.md.

SLUICE_CHAOS_SEED=<n> replays one order and timing. A second test kills the redis-server of a `sluice run`
process (what failed with "run chaos does not exist" while that Redis was memory-only)."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import threading
import time

import httpx
import pytest

from services.front_door.run_file import RunFile, load_run_file
from services.front_door.stack_start import stack_token, start_stack
from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from services.run_state import run_key
from services.run_state.prompt_ledger import skipped_prompts
from services.run_state.trainer_progress import trained_steps
from services.runtime.processes import start_redis
from services.runtime.redis_clients import sync_redis
from tests.e2e.run_checks import assert_run_complete
from tests.e2e.test_sluice_run import start, write_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAULTS = [
    "rollout",
    "trainer",
    "actor_fwd",
    "reference",
    "advantage",
    "tq-controller",
    "tq-shard shard-0",
    "dcs",
    "engine-0",
    "redis",
]
STEPS_PER_FAULT = 2
SYNC_S = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def _auth(lr: LocalRun) -> dict[str, str]:
    return {"authorization": f"Bearer {lr.token}"} if lr.token else {}


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
        text = httpx.get(self.lr.engine_urls[0] + "/metrics", headers=_auth(self.lr), timeout=10).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("sluice_engine_requests_total{") and 'finish="abort"' not in line
        )

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
        with httpx.Client(timeout=2, headers=_auth(self.lr)) as http:
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
    return {
        "fault": fault,
        "at_step": at_step,
        "recover_s": round(time.monotonic() - killed, 1),
        "regenerated": max(0, round(ledger.regenerated() - regenerated)),
        "also_restarted": others,
    }


def _table(rows: list[dict]) -> str:
    lines = [
        "| fault (kill -9) | at step | time to recover (s) | samples regenerated | samples lost | also restarted |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['fault']} | {r['at_step']} | {r['recover_s']} | {r['regenerated']} | {r['lost']} | "
        f"{', '.join(r['also_restarted']) or '-'} |"
        for r in rows
    ]
    return "\n".join(lines)


def test_every_service_killed_once_and_the_run_trains_every_sample_once(model_dir, tmp_path, fork_server):
    seed = int(os.environ.get("SLUICE_CHAOS_SEED", "0")) or random.randrange(1, 1 << 30)
    rng = random.Random(seed)
    order = rng.sample(FAULTS, len(FAULTS))
    run_file = RunFile(
        name="chaos",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=4,
        num_steps=5 * len(FAULTS),
        checkpoint_interval=1,
        ref_update_interval=2,
        algorithm={"decoupled": True, "kl_coef": 0.01},
        rollout={"max_new_tokens": 16},
        optim={"lr": 1e-4},
        stack={
            "output_dir": str(tmp_path / "runs"),
            "coordinator_port": 0,
            # a broadcast to a killed receiver, or from a killed trainer, fails at its deadline: the tiny model's
            # syncs take milliseconds, so 5 s is ample even on a loaded machine
            "engine_flags": {"weight_sync_timeout_s": SYNC_S},
            "role_flags": {
                "actor_fwd": {"lease_s": 3, "weight_sync_timeout_s": SYNC_S},
                "reference": {"lease_s": 3, "weight_sync_timeout_s": SYNC_S},
                "advantage": {"lease_s": 3},
                "trainer": {"weight_sync_timeout_s": SYNC_S, "republish_check_s": 2},
            },
        },
    )
    run = run_file.run_config()
    token, _ = stack_token("", run_file.directories()["run"])  # as `sluice run` makes one
    with start_stack(run_file, token, forker=fork_server) as lr:
        assert lr.token and lr.redis_password and lr.redis_data_dir  # the defaults: token, password, AOF
        lr.submit()
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


def _redis_server_of(parent: int) -> int:
    """The pid of the redis-server `parent` runs as its child."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/comm") as f:  # redis-server rewrites its cmdline, not its comm
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if ppid == parent and comm == "redis-server":
            return int(entry)
    raise AssertionError(f"no redis-server child of {parent}")


def test_sluice_run_with_its_defaults_survives_its_redis_killed(tmp_path, fork_server):
    path = write_run(str(tmp_path), "chaos-redis", steps=8, interval=0)
    run_dir = tmp_path / "runs" / "chaos-redis"
    proc = start(path)
    lines, killed = [], None
    for line in proc.stdout:  # until it exits
        lines.append(json.loads(line))
        if lines[-1].get("step") == 1 and killed is None:
            killed = _redis_server_of(proc.pid)
            password = (run_dir / "redis-password").read_text().strip()
            with open(f"/proc/{killed}/cmdline", "rb") as f:
                assert password.encode() not in f.read()  # in its 0600 redis.conf, not its argv
            os.kill(killed, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    assert killed is not None and lines[-1]["event"] == "finished" and lines[-1]["steps"] == 8
    assert stat.S_IMODE(os.stat(run_dir / "redis-password").st_mode) == 0o600
    assert json.loads((run_dir / "stack.json").read_text())["redis_password_file"] == str(run_dir / "redis-password")
    # the supervisor started it again on its port and file: that log shows two starts
    (log,) = (run_dir / "logs").glob("redis-*.log")
    assert log.read_text().count("Ready to accept connections") == 2
    # its append-only file holds the whole run, behind the same password: every sample trained exactly once
    run = load_run_file(path).run_config()
    server, url = start_redis(log_dir=str(tmp_path), data_dir=str(run_dir / "redis"), password=password)
    try:
        with sync_redis(url, password=password) as r:
            steps, skipped = trained_steps(r, run.name), skipped_prompts(r, run.name)
    finally:
        server.stop()
    assert sorted(steps) == list(range(run.num_steps))
    trained = [i for rec in steps.values() for i in rec["samples"]]
    expected = {
        f"{p}:{k}"
        for p in range(run.num_steps * run.rollout_batch_size + len(skipped))
        if p not in skipped
        for k in range(run.group_rows)
    }
    assert len(trained) == len(set(trained)) and set(trained) == expected
