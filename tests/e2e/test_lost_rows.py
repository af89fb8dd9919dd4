"""A storage shard that comes back without its data (its journal lost with its disk) in the middle of a
fully-async run (every service its own process): the controller marks the rows it held lost, readers holding
them claim again, the rollout generates the groups the trainer had not consumed again, and the run finishes
with every sample trained exactly once."""

from __future__ import annotations

import os
import shutil
import signal
import time

import httpx
import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.partitions import ACTOR_TRAIN_TASK, task_name
from services.run_contract.run_config import RunConfig
from services.transferqueue.client.queue import TransferQueue
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def wait_for_untaken_rows(tq: TransferQueue, run: RunConfig, timeout_s: float = 120.0) -> int:
    """Rows of the run written but neither consumed nor leased by the training task, once there are some:
    only those must be generated again when their shard loses them (a fixed sleep raced a slow rollout)."""
    task, deadline = task_name(run.name, ACTOR_TRAIN_TASK), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        untaken = 0
        for info in tq.list_partitions(f"{run.name}/"):
            progress = next((t for t in info.tasks if t.task == task), None)
            untaken += info.rows - (progress.consumed + progress.leased if progress else 0)
        if untaken:
            return untaken
        time.sleep(0.2)
    raise AssertionError(f"the rollout wrote no rows the stopped trainer had not taken within {timeout_s} s")


def stop_holding_untaken_rows(tq: TransferQueue, run: RunConfig, pid: int, tries: int = 20) -> None:
    """SIGSTOP the trainer at a moment when rows it has not taken exist: stopped first, it may hold every row the
    rollout may write (its claim of the next step's rows while a publish is unfinished), so the rollout waits at
    its bound with nothing untaken; so the rows are seen untaken, the trainer stopped, and seen untaken again."""
    for _ in range(tries):
        wait_for_untaken_rows(tq, run)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)  # a claim already sent lands
        try:
            wait_for_untaken_rows(tq, run, timeout_s=5.0)
            return
        except AssertionError:
            os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"no moment with untaken rows and the trainer stopped in {tries} tries")


@pytest.mark.parametrize("algorithm", [{}, {"estimator": "ppo", "lam": 0.95}], ids=["grpo", "ppo-critic"])
def test_rows_lost_with_a_shard_are_generated_again_and_trained_once(tmp_path, algorithm, fork_server):
    model_dir = init_model(str(tmp_path / "tiny"), preset="tiny", arch="qwen2", seed=7)
    # max_staleness 2: the trainer claims the next step's rows while it publishes, so it may be stopped holding
    # them with its publish unfinished; at max_staleness 1 the rollout could then write nothing nobody has taken
    run = RunConfig(
        name="lost",
        model=model_dir,
        max_staleness=2,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=8,
        micro_batch_size=4,
        num_steps=30,
        rollout={"max_new_tokens": 16},
        optim={"lr": 1e-4},
        algorithm=algorithm,
    )
    with LocalRun(run, log_dir=str(tmp_path / "logs"), forker=fork_server) as lr:
        lr.wait_for_step(3, 300)
        trainer = lr.procs["trainer"].proc
        with TransferQueue(lr.tq.controller_address) as tq:
            stop_holding_untaken_rows(tq, run, trainer.pid)
        try:
            lr.tq.shards[0].kill()
            shutil.rmtree(lr.tq.data_dir)  # its journal is gone with its disk: it comes back empty
            lr.tq.restart_shard(0)
            with TransferQueue(lr.tq.controller_address) as tq:
                lost = {p.name: p.lost_rows for p in tq.list_partitions(f"{run.name}/") if p.lost_rows}
        finally:
            os.kill(trainer.pid, signal.SIGCONT)
        assert lost, "the shard held no rows of the run that were not trained yet"
        lr.wait_for_step(run.num_steps, 400)
        assert_run_complete(lr, run)
        metrics = httpx.get(lr.service_urls()["rollout"] + "/metrics").text
        regenerated = [
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("sluice_rollout_groups_regenerated_total ")
        ]
        assert regenerated and regenerated[0] >= 1, lost
