"""Whole runs: every service its own process (real Redis, TransferQueue, coordinator, built-in engines,
rollout, forward roles, advantage, trainer and critic) on a tiny model and a demo task."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from services.run_contract.run_config import RunConfig
from services.launch.local_run import LocalRun
from services.tracking.timeline import fetch_spans, step_table
from services.model.init_model import init_model
from services.tracking.report import write_report
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def test_fully_async_with_decoupled_ppo_kl_and_two_engines(model_dir, tmp_path, fork_server):
    run = RunConfig(
        name="async",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=8,
        ref_update_interval=2,
        algorithm={"decoupled": True, "tis_clip": 2.0, "kl_coef": 0.01, "entropy_coef": 0.001},
        rollout={"max_new_tokens": 16},
        optim={"lr": 1e-4},
    )
    with LocalRun(run, log_dir=str(tmp_path / "logs"), engines=2, forker=fork_server) as lr:
        assert set(lr.procs) >= {"trainer", "rollout", "advantage", "actor_fwd", "reference"}
        lr.wait_for_step(1, 300)
        # pause over REST: every service (and both engines) reaches a safe point and acknowledges; nothing moves
        with lr.dcs_client() as dcs:
            dcs.pause(run.name)
            deadline = time.monotonic() + 120
            while not all(s.pause_acknowledged for s in dcs.status(run.name).services if s.state != "dead"):
                assert time.monotonic() < deadline, dcs.status(run.name)
                time.sleep(0.2)
            status = dcs.status(run.name)
            roles = {s.role for s in status.services if s.pause_acknowledged}
            # (the advantage role may already have finished every step and left: rollout runs ahead)
            assert roles >= {"trainer", "rollout", "engine", "actor_fwd", "reference"}, status.services
            paused_at = lr.progress()
            # node id -> role while everyone is registered (roles leave when their work is done)
            topology = {n.node_id: n.role for ns in dcs.topology().roles.values() for n in ns}
            time.sleep(3)
            assert lr.progress() == paused_at
            dcs.resume(run.name)
        lr.wait_for_step(run.num_steps, 400)
        steps = assert_run_complete(lr, run)
        assert [steps[s]["metrics"]["weight_version"] for s in range(8)] == list(range(1, 9))
        # the run overlapped: samples one version old were trained (max_staleness 1 was used)
        assert any("1" in steps[s]["metrics"]["staleness"] for s in steps)
        assert all("kl" in steps[s]["metrics"] and "tis_weight_mean" in steps[s]["metrics"] for s in steps)
        # every service froze its start-up heap out of the collector's way (services/runtime/heap.py)
        for lane, url in lr.service_urls().items():
            metrics = httpx.get(url.rstrip("/") + "/metrics").text
            frozen = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("sluice_gc_frozen_objects ")]
            assert frozen and frozen[0] > 10_000, lane
        # both engines generated (requests balanced across them)
        for url in lr.engine_urls:
            assert "sluice_engine_requests_total" in httpx.get(url + "/metrics").text
            counts = [
                line
                for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith("sluice_engine_requests_total{")
            ]
            assert sum(float(line.split()[-1]) for line in counts) > 0
        with lr.dcs_client() as dcs:  # actor_fwd took every version, the reference every second one
            cursors = dcs.cursors(run.name)
            assert cursors["actor_fwd"] == 8 and cursors["reference"] == 8
            loads = [(r.node_id, r.version) for r in dcs.sync_reports(run.name, 200) if "load" in r.seconds]
        assert sorted(v for node, v in loads if topology.get(node) == "reference") == [2, 4, 6, 8]
        assert sorted(v for node, v in loads if topology.get(node) == "actor_fwd") == list(range(1, 9))
        # the rollout notices the trainer's last step on its next progress poll
        deadline = time.monotonic() + 30
        while (status := httpx.get(lr.procs["rollout"].status_url + "/status").json())["state"] != "finished":
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status["ready"]
        # every service recorded where its time went, tagged with steps and versions
        spans = fetch_spans(lr.service_urls())
        names = {lane: {s["name"] for s in lane_spans} for lane, lane_spans in spans.items()}
        assert names["trainer"] >= {"claim", "train", "publish"}
        assert names["rollout"] >= {"generate", "reward", "put"}
        assert names["advantage"] >= {"claim", "advantage", "put"}
        assert names["actor_fwd"] >= {"claim", "forward", "put", "weight_load"}
        assert names["reference"] >= {"forward", "weight_load"}
        assert all(names[f"engine-{i}"] >= {"generate", "weight_load"} for i in range(2))
        # --pause-mode auto: the built-in engines took every version while generating, never paused
        assert not any("pause" in names[f"engine-{i}"] for i in range(2))
        assert sorted(s["step"] for s in spans["trainer"] if s["name"] == "publish") == list(range(8))
        assert [row["step"] for row in step_table(spans)] == list(range(8))


def test_data_parallel_trainer_ranks_share_each_global_batch(model_dir, tmp_path, fork_server):
    run = RunConfig(
        name="dp",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        global_batch_size=8,
        micro_batch_size=2,
        num_steps=3,
        rollout={"max_new_tokens": 12},
        optim={"lr": 1e-4},
    )
    with LocalRun(run, log_dir=str(tmp_path / "logs"), trainer_ranks=2, forker=fork_server) as lr:
        lr.wait_for_step(run.num_steps, 400)
        steps = assert_run_complete(lr, run)
        assert all(steps[s]["metrics"]["dp_size"] == 2 for s in steps)
        # both ranks trained every step (rank 1 follows rank 0 through the group)
        status = httpx.get(lr.procs["trainer-1"].status_url + "/status").json()
        assert status["step"] == run.num_steps - 1
    # rank 0 tracked each step into the run dir (<log_dir>/<run name>: complete once the trainer stopped), which
    # `sluice report` reads
    run_dir = tmp_path / "logs" / run.name
    assert [json.loads(line)["step"] for line in (run_dir / "steps.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert json.loads(open(write_report(str(run_dir))["summary"]).read())["steps"] == 3


def test_colocate_ppo_with_critic_and_kl_reward(model_dir, tmp_path, fork_server):
    run = RunConfig(
        name="colocate",
        model=model_dir,
        mode="colocate",
        max_staleness=0,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=8,
        micro_batch_size=4,
        num_steps=3,
        algorithm={"estimator": "ppo", "kl_coef": 0.01, "kl_in_reward": True, "lam": 0.95, "decoupled": True},
        rollout={"max_new_tokens": 16},
        optim={"lr": 1e-4},
    )
    with LocalRun(run, log_dir=str(tmp_path / "logs"), forker=fork_server) as lr:
        assert set(lr.procs) >= {"trainer", "critic", "rollout", "advantage", "reference", "actor_fwd"}
        lr.wait_for_step(run.num_steps, 400)
        steps = assert_run_complete(lr, run)
        assert all(steps[s]["metrics"]["staleness"] == {"0": run.rows_per_step} for s in steps)
        critic_metrics = httpx.get(lr.procs["critic"].status_url + "/metrics").text
        assert "sluice_critic_value_loss " in critic_metrics and "sluice_trainer_loss" not in critic_metrics
        assert "sluice_trainer_loss " in httpx.get(lr.procs["trainer"].status_url + "/metrics").text


def test_trainer_and_rollout_killed_mid_run_resume_without_skipping_or_repeating(model_dir, tmp_path, fork_server):
    # 12 steps: the engine restarted after step 6 must generate some of the steps after it (the rollout runs
    # at most a couple of steps ahead), so publishes follow its return (docs/operations.md: one that comes back
    # after the last publish keeps its initial weights)
    run = RunConfig(
        name="restart",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=4,
        num_steps=12,
        checkpoint_interval=1,
        algorithm={"decoupled": True},
        # a 0.5 s reward (tests/e2e/slow_rewards.py): the tiny model's 12 steps took ~1.3 s in all, over before
        # the faults below could land mid-run
        rollout={
            "max_new_tokens": 16,
            "prompts": "demo:letters",
            "reward": "import:tests.e2e.slow_rewards:letters_slowly",
        },
        optim={"lr": 1e-4},
    )
    ckpt = tmp_path / "ckpt"
    with LocalRun(
        run,
        log_dir=str(tmp_path / "logs"),
        checkpoint_dir=str(ckpt),
        engine_args=("--weight-sync-timeout-s", "20"),
        role_args={
            "actor_fwd": ["--lease-s", "3"],
            "trainer": ["--weight-sync-timeout-s", "20", "--republish-check-s", "2"],
        },
        forker=fork_server,
    ) as lr:
        lr.wait_for_step(2, 300)
        lr.procs["trainer"].kill()  # SIGKILL: no clean shutdown
        killed_at = lr.progress()
        assert os.path.isdir(ckpt / "actor")
        lr.start_role("trainer")
        lr.wait_for_step(3, 300)
        lr.procs["rollout"].kill()  # its in-flight groups are lost; no prompt may be skipped or repeated
        lr.start_role("rollout")
        lr.wait_for_step(5, 300)
        lr.procs["actor_fwd"].kill()  # its claimed rows return when the lease lapses
        lr.start_role("actor_fwd")
        lr.wait_for_step(6, 300)
        # back with its initial weights: it drops out of syncs while down and gets the weights again
        # (the next publish, or the trainer's lag check if the run would otherwise wait on it)
        lr.restart("engine-0")  # SIGKILL, then started again on its port
        lr.wait_for_step(run.num_steps, 400)
        # a receiver killed mid-sync, or a sync that times out on a loaded machine, burns that version number
        # (the retry takes the next): samples generated across a burnt number may be trained one version more
        # than the bound behind, and are reported. Versions published = steps + numbers burnt.
        steps = assert_run_complete(lr, run, staleness_bounded=False)
        with lr.dcs_client() as dcs:
            burnt = dcs.latest_weights(run.name).version - run.num_steps
        assert 0 <= burnt <= 6  # the faults above burn a few numbers, not one per step (12)
        stalest = max(int(s) for rec in steps.values() for s in rec["metrics"]["staleness"])
        assert stalest <= run.max_staleness + burnt, f"staleness {stalest} with {burnt} version numbers burnt"
        forward_log = (tmp_path / "logs" / "actor_fwd.log").read_text()
        assert "loaded the published weights from a checkpoint" in forward_log
        log = (tmp_path / "logs" / "trainer.log").read_text()
        positions = [json.loads(line) for line in log.splitlines() if '"trainer position"' in line]
        assert len(positions) == 2 and positions[1]["checkpoint"] is not None
        assert positions[1]["next_step"] >= killed_at.next_step - 1
        latest = sorted(os.listdir(ckpt / "actor"))[-1]
        assert latest == f"step_{run.num_steps:08d}"
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(str(ckpt / "actor" / latest), local_files_only=True)


def test_sluice_demo_warm_starts_trains_and_evaluates(tmp_path, fork_server):
    """`sluice demo` end to end on its default task (demo:reverse): a random model, the supervised warm start,
    the run through the front door with held-out evaluation, every sample trained once."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "demo",
            "--steps",
            "2",
            "--groups-per-step",
            "2",
            "--n-samples",
            "4",
            "--preset",
            "tiny",
            "--warm-start-steps",
            "5",
            "--eval-every",
            "1",
            "--eval-prompts",
            "4",
            "--view",
            "json",
            "--workdir",
            str(tmp_path),
            "--filter-groups",
            "none",
        ],  # 5 warm-start steps: every reward 0, every group filtered
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    warm = [json.loads(line) for line in out.stderr.splitlines() if line.startswith('{"event": "warm_start"')]
    assert len(warm) == 1 and warm[0]["steps"] == 5 and os.path.isfile(tmp_path / "warm" / "config.json")
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [x["step"] for x in lines if "step" in x] == [0, 1]
    summary = lines[-1]
    assert summary["event"] == "finished" and summary["every_sample_once"] and summary["samples"] == 16
    assert 0.0 <= summary["eval_reward"] <= 1.0  # the held-out eval ran through the engines


def test_fsdp_trainer_over_two_ranks_trains_publishes_and_checkpoints(model_dir, tmp_path, fork_server):
    run = RunConfig(
        name="fsdp",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        global_batch_size=8,
        micro_batch_size=2,
        num_steps=3,
        checkpoint_interval=2,
        rollout={"max_new_tokens": 12},
        optim={"lr": 1e-4},
    )
    fsdp = ["--backend", "fsdp"]
    with LocalRun(
        run,
        log_dir=str(tmp_path / "logs"),
        trainer_ranks=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        role_args={"trainer": fsdp, "trainer-1": fsdp},
        forker=fork_server,
    ) as lr:
        lr.wait_for_step(run.num_steps, 400)
        steps = assert_run_complete(lr, run)  # engines included: they serve the last published version
        assert all(steps[s]["metrics"]["dp_size"] == 2 for s in steps)
        status = httpx.get(lr.procs["trainer-1"].status_url + "/status").json()
        assert status["step"] == run.num_steps - 1
        last_version = steps[run.num_steps - 1]["metrics"]["weight_version"]
    # the interval checkpoint after step 1 and the final one: the HF weights streamed from both ranks' shards,
    # the optimizer state in DCP shards
    names = sorted(os.listdir(tmp_path / "ckpt" / "actor"))
    assert names == ["step_00000002", f"step_{run.num_steps:08d}"]
    for name in names:
        assert (tmp_path / "ckpt" / "actor" / name / "model.safetensors").is_file()
        assert (tmp_path / "ckpt" / "actor" / name / "sharded" / ".metadata").is_file()
    final = tmp_path / "ckpt" / "actor" / names[-1]
    assert json.loads((final / "trainer_state.json").read_text()) == {
        "next_step": run.num_steps,
        "version": last_version,
    }


def test_megatron_trainer_with_tensor_parallel_two_trains_publishes_and_checkpoints(model_dir, tmp_path, fork_server):
    run = RunConfig(
        name="megatron",
        model=model_dir,
        max_staleness=1,
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        global_batch_size=8,
        micro_batch_size=2,
        num_steps=3,
        checkpoint_interval=2,
        rollout={"max_new_tokens": 12},
        optim={"lr": 1e-4},
    )
    megatron = ["--backend", "megatron", "--tp-size", "2"]
    with LocalRun(
        run,
        log_dir=str(tmp_path / "logs"),
        trainer_ranks=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        role_args={"trainer": megatron, "trainer-1": megatron},
        forker=fork_server,
    ) as lr:
        lr.wait_for_step(run.num_steps, 400)
        assert_run_complete(lr, run)  # engines included: they serve the last published version
        status = httpx.get(lr.procs["trainer-1"].status_url + "/status").json()
        assert status["step"] == run.num_steps - 1
    # interval and final checkpoints: the HF export and megatron's own distributed checkpoint
    root = tmp_path / "ckpt" / "actor"
    assert sorted(os.listdir(root)) == ["step_00000002", f"step_{run.num_steps:08d}"]
    for name in os.listdir(root):
        assert (root / name / "model.safetensors").is_file() and (root / name / "sharded").is_dir()
