"""The default `sluice demo` visibly learns: from a held-out reward of at most 0.3 to at least 0.8, every step's
JSON line carrying the latest held-out score, the report written, every sample trained once (docs/performance.md:
the default run ends at ~0.9; 0.8 leaves room for fully-async scheduling's run-to-run spread).

The demo is stopped with Ctrl-C (SIGINT) as soon as a line shows 0.8, as a user who has seen it learn would:
the default run crosses 0.8 at about step 65-115 of its 200, and the rest proves nothing more. The stop goes the
way a user's Ctrl-C goes: the run paused, every step trained so far checked for exactly-once, the report written,
exit status 130. A run that never reaches 0.8 runs all 200 steps and fails the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]  # the default demo up to its first held-out 0.8 (~1-3 min on two cores); ./dev test runs it

TARGET = 0.8


def test_the_default_demo_climbs_from_at_most_0_3_to_at_least_0_8(tmp_path, fork_server):
    # fork_server: the worker's, whose socket env SLUICE_FORK_SERVER names, so the demo forks its services from it
    demo = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "demo", "--view", "json", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    errors: list[str] = []
    drain = threading.Thread(target=lambda: errors.extend(demo.stderr), daemon=True)  # never blocks the demo
    drain.start()
    lines, interrupted = [], False
    try:
        for text in demo.stdout:
            if not text.startswith("{"):
                continue
            lines.append(json.loads(text))
            reward = lines[-1].get("eval_reward")
            if "step" in lines[-1] and reward is not None and reward >= TARGET and not interrupted:
                demo.send_signal(signal.SIGINT)
                interrupted = True
        demo.wait(120)
    finally:
        demo.kill()
    drain.join(10)
    assert interrupted, "".join(errors)[-3000:]
    assert demo.returncode == 130, "".join(errors)[-3000:]
    steps = [x for x in lines if "step" in x]
    assert [x["step"] for x in steps] == list(range(len(steps)))
    # each line carries the newest held-out score the view has seen; the first lines may come before the
    # version-0 eval lands (it finishes within a second of step 0), so the warm-started model's own score is
    # read from the report below
    evals = [x["eval_reward"] for x in steps]
    known = [e for e in evals if e is not None]
    assert known and evals.index(known[0]) < 10 and all(e is not None for e in evals[evals.index(known[0]) :])
    assert known[0] <= 0.3, evals[:5]
    assert max(known) >= TARGET, evals[-20:]
    summary = lines[-1]
    assert summary["event"] == "interrupted" and summary["every_sample_once"] and summary["failure"] is None
    assert summary["samples"] >= len(steps) * 64  # 8 prompts x 8 samples per step, every step seen trained once
    assert os.path.getsize(summary["report"]["png"]) > 10_000
    with open(summary["report"]["summary"]) as f:
        report = json.load(f)
    assert report["eval_reward"]["first"] <= 0.3 and report["eval_reward"]["best"] >= TARGET  # first: version 0
