"""A weight update in the middle of an episode: the real rollout role and a real engine, the scripted agent's
episodes (tests/rollout/scripted_agent.py) both paused before their last call while the coordinator's
publisher broadcasts new weights (version 1) to the engine. The written sample (the episode's last chain:
third call, the inserted user turn, fourth call) keeps each turn's version, and each turn's log-probs are
the model's under the weights that produced it."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import WeightPublisher
from services.model.loading import load_causal_lm
from tests.engine.conftest import QUESTION, start_engine
from tests.rollout import scripted_agent
from tests.rollout.test_agent_rollout import N, TOKEN, run_rollout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _teacher_forced(model, tokens: torch.Tensor, start: int) -> torch.Tensor:
    with torch.no_grad():  # greedy sampling reports log-probs of the raw logits
        logp = torch.log_softmax(model(tokens[None]).logits[0].float(), dim=-1)
    return logp[start - 1 : -1].gather(-1, tokens[start:, None])[:, 0]


def test_each_turn_keeps_the_version_and_log_probs_of_the_weights_that_made_it(tool_model, tmp_path):
    model_dir, _ = tool_model
    old = load_causal_lm(model_dir)[0]
    new = load_causal_lm(model_dir)[0]
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.02, alpha=1.0)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"prompt": QUESTION[0]["content"], "label": "5"}) + "\n")
    proc, url = start_engine(model_dir, tmp_path, token=TOKEN)
    try:
        with LocalDCS(token=TOKEN, log_dir=str(tmp_path)) as local, DCSClient(local.url, token=TOKEN) as dcs:
            dcs.register(NodeRegistration(role="engine", host="127.0.0.1", ports={"http": int(url.rsplit(":", 1)[1])}))
            trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1"))
            publisher = WeightPublisher(
                dcs, trainer.node_id, "127.0.0.1", timeout_s=30, receiver_roles=["engine"], run_id="default"
            )
            published = []

            def publish():  # once both episodes of the group wait before their last call
                published.append(publisher.publish(new.state_dict().items(), 1).ok)

            barrier = threading.Barrier(N, action=publish, timeout=120)
            scripted_agent.CALLS.clear()
            scripted_agent.BEFORE_LAST_CALL[:] = [barrier.wait]
            try:
                plane = run_rollout(
                    model_dir, str(prompts), url, "import:tests.rollout.scripted_agent:agent", num_steps=1
                )
            finally:
                scripted_agent.BEFORE_LAST_CALL.clear()
                publisher.close()
    finally:
        proc.stop()
    assert published == [True]
    rows = [row for p in plane.partitions.values() for row in p.rows]
    assert len(rows) == N
    changed = False
    for row in rows:
        third, fourth = scripted_agent.CALLS[(int(row["prompt_position"]), int(row["sample_index"]))][2:]
        start = int(row["prompt_length"])
        made_before = len(third["token_ids"])
        inserted = len(fourth["prompt_token_ids"]) - start - made_before
        # the inserted turn carries the version of the output that follows it
        assert row["token_weight_versions"].tolist() == [0] * made_before + [1] * (inserted + len(fourth["token_ids"]))
        assert int(row["weight_version"]) == 0
        tokens, logps = row["tokens"], row["rollout_log_probs"]
        before, after = slice(0, made_before), slice(made_before + inserted, None)
        old_lp, new_lp = _teacher_forced(old, tokens, start), _teacher_forced(new, tokens, start)
        torch.testing.assert_close(logps[before], old_lp[before], atol=2e-4, rtol=0)
        torch.testing.assert_close(logps[after], new_lp[after], atol=2e-4, rtol=0)
        changed = changed or not torch.allclose(old_lp[after], new_lp[after], atol=1e-3)
    assert changed  # the update really changed the last turn's log-probs
