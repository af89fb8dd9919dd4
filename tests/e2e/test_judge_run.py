"""`sluice run` with a judge model as the reward (rollout.reward model:judge, stack.judge): the judge engine starts
as its own service, every step trains on its verdicts, and it is never one of the run's engines: the trainer
never sends it weights, while the policy engine's version moves with every step."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from services.model.init_model import init_model
from tests.e2e.test_sluice_run import start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = """name: judged
model: model
num_steps: 3
n_samples_per_prompt: 2
rollout_batch_size: 2
global_batch_size: 4
micro_batch_size: 2
rollout:
  max_new_tokens: 8
  reward: model:judge
  judge:
    template: "Question: {prompt}\\nAnswer: {response}\\nScore the answer from 0 to 9.\\nSCORE="
    parser: regex:VERDICT=(\\d)
    default: 0.5
    max_new_tokens: 4
optim:
  lr: 1.0e-4
stack:
  init_model: tiny
  coordinator_port: 0
  judge:
    model: judge-model
    engine_flags: {max_running: 8}
"""


def test_a_judged_run_trains_every_step_and_never_updates_the_judge(tmp_path):
    init_model(str(tmp_path / "judge-model"), preset="tiny", seed=11)  # a second random model, not the policy
    (tmp_path / "run.yaml").write_text(RUN)
    proc = start(str(tmp_path / "run.yaml"))
    run_dir = tmp_path / "runs" / "judged"
    lines, seen = [], []
    try:
        for line in proc.stdout:
            lines.append(json.loads(line))
            if "step" in lines[-1]:  # the judge as the run goes on: still serving, never updated or registered
                seen.append(judge_state(run_dir))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 0, err[-3000:]
    assert [e["step"] for e in lines if "step" in e] == [0, 1, 2]
    assert [e["weight_version"] for e in lines if "step" in e] == [1, 2, 3]
    assert lines[-1]["event"] == "finished" and lines[-1]["failure"] is None
    # a random judge never writes VERDICT=<digit>: every sample scores rollout.judge.default
    assert [e["reward_mean"] for e in lines if "step" in e] == [0.5] * 3
    assert len(seen) == 3 and all(judge_version == "default" for judge_version, *_ in seen), seen
    for step, (_, judge_url, engines, judged) in enumerate(seen):
        assert judge_url not in engines and len(engines) == 1, (judge_url, engines)
        assert judged >= 4 * (step + 1)  # the judge answered each sample of the steps trained so far
    assert seen[-1][3] == 12  # one request per sample: 3 steps x 2 groups x 2 samples
    log = (run_dir / "logs" / "rollout.log").read_text()
    assert "judge" in (run_dir / "stack.json").read_text() and "Traceback" not in log
    assert os.path.getsize(run_dir / "logs" / "judge.log") > 0


def judge_state(run_dir) -> tuple[str, str, list[str], float]:
    """(the judge engine's weight version, its URL, the URLs of the run's engine set, the requests the judge
    answered) read now."""
    stack = json.loads((run_dir / "stack.json").read_text())
    with open(stack["auth_token_file"]) as f:
        auth = {"authorization": f"Bearer {f.read().strip()}"}
    version = httpx.get(stack["judge_url"] + "/weight_version", headers=auth, timeout=10).json()["weight_version"]
    engines = httpx.get(f"{stack['coordinator']}/v1/runs/{stack['run_id']}/engines", headers=auth, timeout=10)
    metrics = httpx.get(stack["judge_url"] + "/metrics", headers=auth, timeout=10).text
    judged = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sluice_engine_requests_total{")
    )
    return version, stack["judge_url"], [e["url"] for e in engines.json()["engines"]], judged
