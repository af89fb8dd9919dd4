"""`sluice submit|status|pause|resume|stop|logs` against a real coordinator process (with a bearer token) over
a real Redis; the trainer's steps are reported the way the trainer reports them (POST /v1/runs/<run>/steps)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from services.cli import main as sluice
from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import StepRecord, StepsReport
from services.front_door.run_file import load_run_file

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def dcs(tmp_path_factory):
    with LocalDCS(token=TOKEN, log_dir=str(tmp_path_factory.mktemp("dcs"))) as d:
        yield d


@pytest.fixture
def env(dcs, monkeypatch):
    monkeypatch.setenv("SLUICE_COORDINATOR_URL", dcs.url)
    monkeypatch.setenv("SLUICE_AUTH_TOKEN", TOKEN)


def run_file(tmp_path, name: str, extra: str = "") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nmodel: /nowhere/model\nnum_steps: 3\nn_samples_per_prompt: 2\n"
        f"rollout_batch_size: 2\nglobal_batch_size: 4\nmicro_batch_size: 2\n"
        f"stack:\n  engines: 2\n{extra}"
    )
    return str(path)


def test_submit_then_status_pause_resume_and_stop(env, dcs, tmp_path, capsys):
    assert sluice(["submit", "--no-preflight", run_file(tmp_path, "rest1")]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "event": "submitted",
        "run": "rest1",
        "status": "running",
        "coordinator": dcs.url,
    }
    with DCSClient(dcs.url, token=TOKEN) as client:  # the trainer's report of step 0
        step = StepRecord(step=0, metrics={"reward_mean": 0.25, "loss": 0.5, "weight_version": 1})
        client.report_steps("rest1", StepsReport(next_step=1, weight_version=1, steps=[step]))
    assert sluice(["status", "rest1"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["status"], status["step"], status["num_steps"]) == ("running", 1, 3)
    assert status["last_step"] == {"step": 0, "metrics": {"reward_mean": 0.25, "loss": 0.5, "weight_version": 1}}
    assert sluice(["pause", "rest1"]) == 0
    assert json.loads(capsys.readouterr().out)["desired_state"] == "paused"
    assert sluice(["resume", "rest1"]) == 0
    assert json.loads(capsys.readouterr().out)["desired_state"] == "running"
    assert sluice(["stop", "rest1"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "stopped"
    assert sluice(["resume", "rest1"]) == 1  # a stopped run stays stopped
    assert "the coordinator refused: HTTP 409" in capsys.readouterr().err


def test_a_second_submit_of_the_same_run_is_refused_unless_exist_ok(env, tmp_path, capsys):
    path = run_file(tmp_path, "rest2")
    assert sluice(["submit", "--no-preflight", path]) == 0
    capsys.readouterr()
    assert sluice(["submit", "--no-preflight", path]) == 1
    assert "HTTP 409" in capsys.readouterr().err
    assert sluice(["submit", "--no-preflight", "--exist-ok", path]) == 0
    assert json.loads(capsys.readouterr().out)["event"] == "exists"


def test_submit_checks_the_file_and_the_run_before_posting(env, tmp_path, capsys):
    bad = run_file(tmp_path, "rest3", "  gpus: 2\n")
    assert sluice(["submit", bad]) == 2
    assert f"sluice submit: {bad}:10:3: stack.gpus: unknown key" in capsys.readouterr().err
    missing_model = run_file(tmp_path, "rest4")
    assert sluice(["submit", missing_model]) == 2  # preflight: the model directory does not exist
    err = capsys.readouterr().err
    assert f"{missing_model}:2:1: model: " in err and "/nowhere/model" in err
    assert sluice(["status", "rest4"]) == 1  # nothing was posted
    assert "does not exist" in capsys.readouterr().err


def test_a_wrong_token_or_no_coordinator_is_a_clear_error(env, monkeypatch, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text("wrong\n")
    assert sluice(["status", "--auth-token-file", str(token_file), "anything"]) == 1
    assert "HTTP 401: missing or wrong bearer token" in capsys.readouterr().err
    assert sluice(["pause", "--coordinator", "http://127.0.0.1:9", "anything"]) == 1
    assert "the coordinator cannot be reached" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--auth-token-file"):
        sluice(["status", "--auth-token-file", str(tmp_path / "none"), "anything"])


def test_logs_prints_the_tail_of_a_role_log_and_names_the_ones_there_are(tmp_path, capsys):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "trainer.log").write_text("".join(f"line {i}\n" for i in range(100)))
    (logs / "rollout.log").write_text("r\n")
    (tmp_path / "run" / "stack.json").write_text(json.dumps({"log_dir": str(logs)}))
    assert sluice(["logs", "trainer", "--run-dir", str(tmp_path / "run"), "-n", "3"]) == 0
    assert capsys.readouterr().out == "line 97\nline 98\nline 99\n"
    assert sluice(["logs", "critic", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no log of 'critic'" in err and "there are: rollout, trainer" in err
    with pytest.raises(SystemExit, match="not a run directory"):
        sluice(["logs", "trainer", "--run-dir", str(tmp_path)])


def test_attach_follows_a_run_on_a_coordinator_to_its_end(env, dcs, tmp_path, capsys):
    with DCSClient(dcs.url, token=TOKEN) as client:
        client.create_run(load_run_file(run_file(tmp_path, "attached")).run_config())
        for step in range(3):
            record = StepRecord(step=step, metrics={"reward_mean": step / 10, "weight_version": step + 1})
            client.report_steps("attached", StepsReport(next_step=step + 1, weight_version=step + 1, steps=[record]))
        client.finish_run("attached")
        client.create_run(load_run_file(run_file(tmp_path, "attached-failing")).run_config())
        client.fail_run("attached-failing", "rollout", "reward function raised KeyError: 'label'")
    assert sluice(["run", "--attach", dcs.url, "attached", "--view", "json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == {"event": "attached", "run": "attached", "coordinator": dcs.url}
    assert [line["reward_mean"] for line in lines[1:-1]] == [0.0, 0.1, 0.2]
    assert lines[-1]["event"] == "finished" and lines[-1]["steps"] == 3
    assert sluice(["run", "--attach", dcs.url, "attached-failing", "--view", "json"]) == 1
    assert "run attached-failing failed: rollout: reward function raised KeyError: 'label'" in capsys.readouterr().err
    assert sluice(["run", "--attach", dcs.url, "no-such-run"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_logs_follow_prints_what_is_appended_until_ctrl_c(tmp_path):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    log = logs / "rollout.log"
    log.write_text("old 1\nold 2\n")
    (tmp_path / "run" / "stack.json").write_text(json.dumps({"log_dir": str(logs)}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "logs", "rollout", "-f", "-n", "1", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "old 2\n"
        with open(log, "a") as f:
            f.write("new 3\n")
        assert proc.stdout.readline() == "new 3\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("delay_s", [0.0, 1.0])  # as it starts following, and while it follows
def test_ctrl_c_while_attached_detaches_and_leaves_the_run_going(dcs, tmp_path, delay_s):
    import os
    import time

    name = f"watched-{int(delay_s * 1000)}"
    with DCSClient(dcs.url, token=TOKEN) as client:
        client.create_run(load_run_file(run_file(tmp_path, name)).run_config())
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "run", "--attach", dcs.url, name, "--view", "json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "SLUICE_AUTH_TOKEN": TOKEN},
        )
        try:
            assert json.loads(proc.stdout.readline())["event"] == "attached"
            time.sleep(delay_s)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 130, err[-2000:]
        assert json.loads(out.splitlines()[-1])["event"] == "interrupted"
        run = client.run(name)  # an attached terminal's Ctrl-C is not the run's: it neither pauses nor stops
        assert run.desired_state == "running" and run.status not in ("stopped", "paused")


def test_engines_add_list_and_remove(env, tmp_path, capsys):
    assert sluice(["submit", "--no-preflight", run_file(tmp_path, "rest_engines")]) == 0
    capsys.readouterr()
    assert sluice(["engines", "add", "rest_engines", "http://gpu-0:30000"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert (added["event"], added["url"], added["source"], added["alive"]) == (
        "added",
        "http://gpu-0:30000",
        "added",
        False,
    )
    assert sluice(["engines", "list", "rest_engines"]) == 0
    assert [e["url"] for e in json.loads(capsys.readouterr().out)["engines"]] == ["http://gpu-0:30000"]
    assert sluice(["engines", "remove", "rest_engines", "http://gpu-0:30000"]) == 0
    assert json.loads(capsys.readouterr().out)["event"] == "removed"
    assert sluice(["engines", "list", "rest_engines"]) == 0
    assert json.loads(capsys.readouterr().out) == {"engines": [], "removed": ["http://gpu-0:30000"]}
    assert sluice(["engines", "add", "rest_engines", "gpu-0:30000"]) == 2  # no scheme: refused before sending
    assert "scheme" in capsys.readouterr().err
    assert sluice(["engines", "remove", "rest_engines", "http://gpu-9:30000"]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert sluice(["engines", "add", "no_such_run", "http://gpu-0:30000"]) == 1
    assert "no_such_run does not exist" in capsys.readouterr().err
