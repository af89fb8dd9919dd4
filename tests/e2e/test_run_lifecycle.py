"""A run's lifecycle with every service its own process: a run that cannot start fails loudly (status failed,
naming the role and the problem) and every role process exits instead of waiting; a stopped run's roles exit
cleanly, and the same stack (Redis, TransferQueue, coordinator) then trains the next run."""

from __future__ import annotations

import shutil
import time

import pytest

from services.dcs.models import RunStatus
from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROLES = ("rollout", "advantage", "trainer")  # a GRPO run's roles


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def small_run(name: str, model: str, num_steps: int = 2, **rollout) -> RunConfig:
    return RunConfig(
        name=name,
        model=model,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=num_steps,
        rollout={"max_new_tokens": 8, **rollout},
        optim={"lr": 1e-4},
    )


def wait_for_status(lr: LocalRun, run_id: str, wanted: str, timeout_s: float) -> RunStatus:
    deadline = time.monotonic() + timeout_s
    with lr.dcs_client() as dcs:
        while (status := dcs.status(run_id)).status != wanted:
            assert time.monotonic() < deadline, f"{run_id} is {status.status}, not {wanted}; logs in {lr.log_dir}"
            time.sleep(0.2)
    return status


def wait_for_exit(lr: LocalRun, names, timeout_s: float) -> dict[str, int]:
    """Each process's exit code, once every one of them exited (none may hang)."""
    deadline = time.monotonic() + timeout_s
    while any(lr.procs[name].alive() for name in names):
        hanging = [name for name in names if lr.procs[name].alive()]
        assert time.monotonic() < deadline, f"{hanging} did not exit; logs in {lr.log_dir}"
        time.sleep(0.2)
    return {name: lr.procs[name].proc.returncode for name in names}


def test_runs_that_cannot_start_fail_loudly_and_their_roles_exit(model_dir, tmp_path, fork_server):
    bad_reward = small_run("bad-reward", model_dir, reward="import:no_such_module_zz:score")
    with LocalRun(bad_reward, log_dir=str(tmp_path / "a"), submit=False, forker=fork_server) as lr:
        lr.submit()
        failure = wait_for_status(lr, bad_reward.name, "failed", 120).failure
        assert failure.role == "rollout" and "rollout.reward" in failure.message
        assert "no_such_module_zz" in failure.message
        codes = wait_for_exit(lr, ROLES, 120)
        assert codes["rollout"] != 0 and codes["trainer"] == 0 and codes["advantage"] == 0, codes

        # the next run on the same stack: its model directory lacks config.json (its engine has the whole one)
        broken = tmp_path / "no-config"
        shutil.copytree(model_dir, broken)
        (broken / "config.json").unlink()
        no_config = small_run("no-config", model_dir)
        with LocalRun(no_config, log_dir=str(tmp_path / "b"), stack=lr, submit=False) as lr2:
            with lr2.dcs_client() as dcs:
                dcs.create_run(no_config.model_copy(update={"model": str(broken)}))
            failure = wait_for_status(lr2, no_config.name, "failed", 120).failure
            codes = wait_for_exit(lr2, ROLES, 120)
            # a role that reads the model directory names what is missing (the other one may report it too,
            # or see the run failed first and exit 0)
            assert failure.role in ("rollout", "trainer") and "config.json is missing" in failure.message
            assert str(broken) in failure.message and codes[failure.role] != 0 and codes["advantage"] == 0, codes
            with lr2.dcs_client() as dcs:
                later = dcs.status(no_config.name).later_failures
            assert all("config.json is missing" in f.message for f in later), later


def test_a_stopped_run_ends_cleanly_and_the_stack_trains_the_next_run(model_dir, tmp_path, fork_server):
    first = small_run("long", model_dir, num_steps=1000)
    with LocalRun(first, log_dir=str(tmp_path / "a"), forker=fork_server) as lr:
        lr.wait_for_step(1, 300)
        with lr.dcs_client() as dcs:
            assert dcs.stop_run(first.name).status == "stopped"
        assert wait_for_exit(lr, ROLES, 120) == {name: 0 for name in ROLES}
        stopped_at = lr.progress()
        assert 1 <= stopped_at.next_step < first.num_steps

        second = small_run("next", model_dir)
        with LocalRun(second, log_dir=str(tmp_path / "b"), stack=lr) as lr2:
            lr2.wait_for_step(second.num_steps, 300)
            assert_run_complete(lr2, second)
            wait_for_status(lr2, second.name, "finished", 60)
        assert lr.progress() == stopped_at  # the stopped run stayed where it stopped
        with lr.dcs_client() as dcs:
            assert dcs.run(first.name).status == "stopped"
