"""`sluice run run.yaml` as a user runs it: one subprocess that writes a tiny model, starts every service,
submits the run, prints one JSON line per trained step and a summary, and exits 0 soon after, every service
stopped; Ctrl-C pauses and stops it, and `--resume` continues from its last checkpoint; a service that cannot
start fails it loudly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis

from services.cli import main as sluice
from services.run_state.trainer_progress import trained_steps
from services.runtime.processes import start_redis

# fork_server: the worker's, whose socket env SLUICE_FORK_SERVER names, so `sluice run` forks its services from it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("fork_server")]

RUN = """name: {name}
model: {model}
num_steps: {steps}
n_samples_per_prompt: 2
rollout_batch_size: 2
global_batch_size: 4
micro_batch_size: 2
checkpoint_interval: {interval}
rollout:
  max_new_tokens: 8
{reward}optim:
  lr: 1.0e-4
stack:
  init_model: tiny
  coordinator_port: 0
{stack}"""


def write_run(
    directory, name: str, steps: int = 3, model: str = "model", stack: str = "", reward: str = "", interval: int = 1
) -> str:
    path = os.path.join(directory, "run.yaml")
    with open(path, "w") as f:
        f.write(
            RUN.format(
                name=name,
                steps=steps,
                model=model,
                stack=stack,
                interval=interval,
                reward=f"  reward: {reward}\n" if reward else "",
            )
        )
    return path


def start(path: str, *flags: str, cwd: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", path, "--view", "json", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd or os.path.dirname(path),
    )


def lines_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def service_processes(run_dir) -> dict[int, str]:
    """pid -> command (`sluice <command>`) of each Python service of the run, as <run dir>/stack.json lists them:
    `sluice run`'s children, or a fork server's (its own, or the test worker's that env SLUICE_FORK_SERVER
    names), whose command lines setproctitle wrote as one string."""
    procs = {}
    for pid in json.loads((run_dir / "stack.json").read_text())["service_pids"].values():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = " ".join(f.read().decode(errors="replace").split("\0")).split()
        except OSError:  # gone meanwhile
            continue
        if "services.cli" in argv:
            procs[pid] = argv[argv.index("services.cli") + 1]
    return procs


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sluice_run_trains_to_the_end_and_prints_a_line_per_step_and_a_summary(tmp_path, capsys):
    redis_proc, redis_url = start_redis(log_dir=str(tmp_path))  # --redis-url: the run's state outlives it
    # a reward module beside the run file, started from another directory: found all the same
    (tmp_path / "my_scorer.py").write_text("def score(response, fields, prompt):\n    return len(response) % 2\n")
    (tmp_path / "elsewhere").mkdir()
    try:
        proc = start(
            write_run(str(tmp_path), "cli-run", reward="import:my_scorer:score"),
            "--redis-url",
            redis_url,
            cwd=str(tmp_path / "elsewhere"),
        )
        lines, services, finished_at = [], {}, None
        for line in proc.stdout:  # until it exits (its services write to their logs, not this pipe)
            lines.append(json.loads(line))
            if lines[-1].get("event") == "running":  # every service started: its processes, to check below
                services = service_processes(tmp_path / "runs" / "cli-run")
            finished_at = time.monotonic() if lines[-1].get("event") == "finished" else finished_at
        proc.wait(timeout=60)
        exited_after_s = time.monotonic() - finished_at if finished_at is not None else None
        err = proc.stderr.read()
        assert proc.returncode == 0, err[-3000:]
        with redis.Redis.from_url(redis_url, decode_responses=True) as r:
            assert sorted(trained_steps(r, "cli-run")) == [0, 1, 2]
    finally:
        redis_proc.stop()
    # it exits soon after the run's end, its services stopped together, not one after another (issue 33: a
    # GPU run took over 60 s; here it takes ~1 s, ~3.5 s when stopped one by one), and leaves none behind
    assert exited_after_s is not None and exited_after_s < 10, exited_after_s
    assert {"engine", "trainer", "rollout", "advantage", "dcs", "tq-controller", "tq-shard"} <= set(services.values())
    assert [services[pid] for pid in services if running(pid)] == []
    assert [e.get("event") for e in lines[:2]] == ["starting", "running"]
    assert [e["step"] for e in lines if "step" in e] == [0, 1, 2]
    assert all(0 <= e["reward_mean"] <= 1 and e["weight_version"] == e["step"] + 1 for e in lines if "step" in e)
    summary = lines[-1]
    assert summary["event"] == "finished" and summary["steps"] == 3 and summary["failure"] is None
    run_dir = tmp_path / "runs" / "cli-run"
    assert (run_dir / "steps.jsonl").exists()  # the trainer's run files are in the run dir, with the report
    assert summary["report"] and all(os.path.exists(p) for p in summary["report"].values()), summary["report"]
    assert json.loads((run_dir / "stack.json").read_text())["log_dir"] == str(run_dir / "logs")
    assert sluice(["logs", "trainer", "--run-dir", str(run_dir), "-n", "5"]) == 0
    assert capsys.readouterr().out.strip()
    # the same run dir again holds its checkpoints: a new run there must say --resume
    again = start(str(tmp_path / "run.yaml"))
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2 and "stack.checkpoint_dir:" in err and "add --resume" in err


def test_ctrl_c_pauses_and_stops_and_resume_finishes_from_the_checkpoint(tmp_path):
    # far more steps than train while it pauses; no checkpoint interval: the one resumed from is the trainer's
    # on its way out (checkpoint.on_stop)
    path = write_run(str(tmp_path), "cli-resume", steps=30, interval=0)
    proc = start(path)
    seen = []
    for line in proc.stdout:  # until the second step is recorded
        seen.append(json.loads(line))
        if seen[-1].get("step") == 1:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    lines = seen + lines_of(out)
    assert proc.returncode == 130, err[-3000:]
    assert {"paused", "stopping"} <= {e.get("event") for e in lines}
    assert lines[-1]["event"] == "interrupted" and lines[-1]["steps"] < 30
    # an interrupted run writes its report too, from the steps it trained (not only `sluice report` afterwards)
    report = lines[-1]["report"]
    assert report and all(os.path.exists(p) for p in report.values()), report
    summary = json.loads((tmp_path / "runs" / "cli-resume" / "summary.json").read_text())
    assert summary["steps"] >= 2, summary  # steps 0 and 1 were seen before Ctrl-C
    interrupted_at = lines[-1]["steps"]
    resumed = start(path, "--resume")
    out, err = resumed.communicate(timeout=540)
    assert resumed.returncode == 0, err[-3000:]
    lines = lines_of(out)
    steps = [e["step"] for e in lines if "step" in e]
    # from the checkpoint on (the trainer checkpoints its last finished step on the way out; the step it was
    # publishing when it paused may be recorded after the summary was written)
    assert steps and steps == list(range(steps[0], 30)), (out, err[-2000:])
    assert interrupted_at <= steps[0] <= interrupted_at + 1, (interrupted_at, steps)
    assert lines[-1]["event"] == "finished" and lines[-1]["steps"] == 30


def test_a_service_that_cannot_start_fails_the_run_loudly(tmp_path):
    path = write_run(str(tmp_path), "cli-bad-flag", stack="  role_flags: {trainer: {warmup_steps: 3}}\n")
    proc = start(path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "sluice run: a service did not start: trainer exited" in err and "--warmup-steps" in err
    assert "logs in " in err


def test_an_operator_stop_from_another_terminal_ends_sluice_run_with_3(tmp_path):
    # far more steps than train before the stop lands (a step takes ~0.15 s, and the refused stop below
    # takes a few seconds: with 30 steps the run once finished before the stop)
    proc = start(write_run(str(tmp_path), "cli-stop", steps=300))
    coordinator = token_file = None
    for line in proc.stdout:  # the generated token's file and the coordinator's URL, then the first trained step
        event = json.loads(line)
        coordinator = event.get("coordinator", coordinator)
        token_file = event.get("auth_token_file", token_file)
        if event.get("step") == 0:
            break
    # no token given: the stack made one (mode 0600) and requires it, so its engines' weight updates are closed
    assert token_file and os.stat(token_file).st_mode & 0o777 == 0o600
    assert httpx.get(f"{coordinator}/v1/runs/cli-stop", timeout=10).status_code == 401
    env = {**os.environ, "SLUICE_COORDINATOR_URL": coordinator}
    env.pop("SLUICE_AUTH_TOKEN", None)
    refused = subprocess.run(
        [sys.executable, "-m", "services.cli", "stop", "cli-stop"], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 1 and "401" in refused.stderr
    env["SLUICE_AUTH_TOKEN_FILE"] = token_file
    stop = subprocess.run(
        [sys.executable, "-m", "services.cli", "stop", "cli-stop"], capture_output=True, text=True, env=env, timeout=60
    )
    assert stop.returncode == 0, stop.stderr
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, err[-3000:]
    summary = lines_of(out)[-1]
    assert summary["event"] == "stopped" and summary["steps"] < 300
    assert "run cli-stop stopped" in err
    # a stopped run writes its report too
    assert summary["report"] and all(os.path.exists(p) for p in summary["report"].values()), summary["report"]
