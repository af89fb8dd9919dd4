"""Partial rollout against the real engine: a weight update with pause mode abort cuts a running
request short; the rollout's engine pool resubmits prompt + partial output under the new weights and
the sample keeps the spans of both versions, with log-probs of each part under its own weights."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import WeightPublisher
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.response_batch import ResponseBatch, response_log_probs
from services.rollout.engine_pool import EnginePool
from tests.engine.conftest import start_engine

pytestmark = pytest.mark.slow


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("sluice_engine_running_requests"):
            return float(line.split()[-1])
    return 0.0


N = 2040  # long enough (the tiny model's context is 2048) that the update lands mid-request on a fast engine


def test_aborted_request_resumes_under_new_weights_with_both_spans(tiny_model_dir, tmp_path):
    torch.set_num_threads(1)
    new_dir = init_model(str(tmp_path / "new"), preset="tiny", arch="qwen2", seed=99)
    old_model, new_model = load_causal_lm(tiny_model_dir)[0], load_causal_lm(new_dir)[0]
    prompt = [11, 22, 33, 44]
    proc, url = start_engine(tiny_model_dir, tmp_path)
    try:
        with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
            dcs.register(NodeRegistration(role="engine", host="127.0.0.1", ports={"http": int(url.rsplit(":", 1)[1])}))
            trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1"))
            publisher = WeightPublisher(
                dcs,
                trainer.node_id,
                "127.0.0.1",
                timeout_s=30,
                receiver_roles=["engine"],
                pause_mode="abort",
                run_id="default",
            )
            pool = EnginePool([url])
            result = {}

            def generate():
                result["sample"] = asyncio.run(
                    pool.generate(prompt, {"temperature": 0, "ignore_eos": True}, max_new_tokens=N, rid="partial")
                )

            worker = threading.Thread(target=generate)
            worker.start()
            deadline = time.monotonic() + 30
            while _running(url) < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.05)  # some tokens under the old weights
            assert publisher.publish(new_model.state_dict().items(), 1).ok
            worker.join(120)
            publisher.close()
        sample = result["sample"]
        assert len(sample.output_ids) == N and sample.resubmits >= 1
        assert [v for v, _, _ in sample.spans] == [0, 1]
        cut = sample.spans[0][2]
        assert sample.spans == [(0, 0, cut), (1, cut, N)] and 0 < cut < N
        assert sample.begin_version == 0 and sample.token_versions() == [0] * cut + [1] * (N - cut)
        # each part is greedy and its log-probs are teacher-forced under the weights that produced it
        tokens = torch.tensor(prompt + sample.output_ids)
        batch = ResponseBatch.build([tokens], [len(prompt)], [N])
        old_lp, new_lp = response_log_probs(old_model, batch)[0], response_log_probs(new_model, batch)[0]
        got = torch.tensor(sample.log_probs)
        torch.testing.assert_close(got[:cut], old_lp[:cut], atol=1e-4, rtol=0)
        torch.testing.assert_close(got[cut:], new_lp[cut:], atol=1e-4, rtol=0)
        assert not torch.allclose(old_lp[cut:], new_lp[cut:], atol=1e-3)  # the update really changed them
    finally:
        proc.stop()
