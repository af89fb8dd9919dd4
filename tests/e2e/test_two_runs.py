"""Two runs at once on one stack (one Redis, one TransferQueue controller and shard, one coordinator), each
with its own engine and roles: both finish, every sample is trained exactly once in its own run, and no run's
rows, tasks, weights, cursors, sync groups or sync reports show up in the other's."""

from __future__ import annotations

import time

import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from services.transferqueue.client.queue import TransferQueue
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# each reward call takes 0.5 s (tests/e2e/slow_rewards.py): a tiny model's runs would otherwise last about a second
# each, less than the one's start can lag the other's on a loaded machine, and never overlap
SLOW_REWARD = "import:tests.e2e.slow_rewards:letters_slowly"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def watch_partitions(tq: TransferQueue, runs: dict[str, LocalRun], timeout_s: float) -> bool:
    """Until every run finished: each partition and each task on it belongs to one run, with that run's
    group size and at most its rows per step. True if both runs had partitions at the same time."""
    deadline, overlapped = time.monotonic() + timeout_s, False
    while True:
        unfinished = [lr for lr in runs.values() if lr.progress().next_step < lr.run.num_steps]
        if not unfinished:
            return overlapped
        assert time.monotonic() < deadline, {name: lr.progress() for name, lr in runs.items()}
        for lr in unfinished:
            lr.check_alive()
        owners = set()
        for info in tq.list_partitions():
            owner, _, name = info.name.partition("/")
            run = runs[owner].run  # a KeyError here is a partition of no run
            assert name.startswith("train_") and info.group_size == run.n_samples_per_prompt, info
            assert info.allocated_rows <= run.rows_per_step, info
            assert all(t.task.startswith(f"{owner}/") for t in info.tasks), info.tasks
            owners.add(owner)
        overlapped = overlapped or len(owners) == len(runs)
        time.sleep(0.02)  # a tiny model's step takes ~0.1 s, and so does the life of its partition


def test_two_runs_on_one_stack_never_mix(model_dir, tmp_path, fork_server):
    # different group sizes, batch sizes, step counts and roles: mixing any of it would show
    a = RunConfig(
        name="run-a",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=8,
        algorithm={"decoupled": True},
        rollout={"max_new_tokens": 8, "prompts": "demo:letters", "reward": SLOW_REWARD},
        optim={"lr": 1e-4},
    )
    b = RunConfig(
        name="run-b",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=4,
        rollout_batch_size=1,
        global_batch_size=4,
        micro_batch_size=4,
        num_steps=10,
        rollout={"max_new_tokens": 8, "prompts": "demo:letters", "reward": SLOW_REWARD},
        optim={"lr": 1e-4, "seed": 1},
    )
    with (
        LocalRun(a, log_dir=str(tmp_path / "a"), submit=False, forker=fork_server) as lr_a,
        LocalRun(b, log_dir=str(tmp_path / "b"), stack=lr_a, submit=False) as lr_b,
    ):
        assert lr_b.dcs is lr_a.dcs and lr_b.tq is lr_a.tq and lr_b.redis_url == lr_a.redis_url
        assert "actor_fwd" in lr_a.procs and "actor_fwd" not in lr_b.procs
        lr_a.submit()  # both runs start at once, their roles already waiting
        lr_b.submit()
        with TransferQueue(lr_a.tq.controller_address) as tq:
            assert watch_partitions(tq, {a.name: lr_a, b.name: lr_b}, 400), "the runs never ran at the same time"
        steps_a, steps_b = assert_run_complete(lr_a, a), assert_run_complete(lr_b, b)
        assert [steps_a[s]["metrics"]["weight_version"] for s in sorted(steps_a)] == list(range(1, 9))
        assert [steps_b[s]["metrics"]["weight_version"] for s in sorted(steps_b)] == list(range(1, 11))
        with lr_a.dcs_client() as dcs:
            assert dcs.latest_weights(a.name).version == 8 and dcs.latest_weights(b.name).version == 10
            # only run-a has an actor_fwd: its cursor is run-a's alone
            assert dcs.cursors(a.name) == {"actor_fwd": 8} and dcs.cursors(b.name) == {}
            reports = {run.name: dcs.sync_reports(run.name, 1000) for run in (a, b)}
            for run in (a, b):
                assert reports[run.name] and all(
                    r.group.startswith(f"sluice-sync-{run.name}-") and r.version <= run.num_steps
                    for r in reports[run.name]
                )
            # no node reported in both runs: each run's trainer, actor_fwd and engine are its own
            nodes = {name: {r.node_id for r in rs} for name, rs in reports.items()}
            assert not nodes[a.name] & nodes[b.name]
            assert dcs.current_group(a.name).name != dcs.current_group(b.name).name
            assert dcs.status(a.name).latest_weight_version == 8 and dcs.status(b.name).latest_weight_version == 10
