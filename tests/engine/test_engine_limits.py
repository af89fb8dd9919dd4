"""The engine's limits, as its own process: requests over a cap get a clear 4xx/503 and change nothing; a
client that goes away has its request dropped; a step that fails fails its requests, makes /health answer
503 and ends the process with exit status 1 (a supervisor restarts it); never a silent hang."""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import WeightPublisher
from services.model.loading import load_causal_lm
from tests.engine.conftest import start_engine

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # engine processes end to end; ./dev test runs it


def _post(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=timeout)


def _queued(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return float(next(x for x in metrics.splitlines() if x.startswith("sluice_engine_waiting_requests ")).split()[1])


@pytest.fixture(scope="module")
def small_engine(tiny_model_dir, tmp_path_factory):
    """One KV slot, two queued samples at most, max_new_tokens at most 2000."""
    proc, url = start_engine(
        tiny_model_dir,
        tmp_path_factory.mktemp("limits"),
        "--max-running",
        "1",
        "--max-queued-requests",
        "2",
        "--max-new-tokens-limit",
        "2000",
    )
    yield url
    proc.stop()


def test_requests_over_a_limit_get_400_and_a_full_queue_503(small_engine):
    url = small_engine
    over = _post(url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2001}})
    assert over.status_code == 400 and "--max-new-tokens-limit" in over.json()["error"]["message"]
    # a prompt as long as the context (the engine's default: the tiny model's max_position_embeddings, 2048)
    # leaves no room: refused, with the length named, single or in a batch, as ids or as text
    context = 2048
    for body in (
        {"input_ids": [5] * context},
        {"input_ids": [[1, 2], [5] * (context + 7)]},
        {"text": "a " * (4 * context)},
    ):
        long = _post(url, {**body, "sampling_params": {"max_new_tokens": 1}})
        assert long.status_code == 400, long.text
        assert f"the context length is {context}" in long.json()["error"]["message"]
    assert _queued(url) == 0
    too_many = _post(url, {"input_ids": [1, 2, 3], "sampling_params": {"n": 3, "max_new_tokens": 4}})
    assert too_many.status_code == 400 and "--max-queued-requests" in too_many.json()["error"]["message"]
    for bad in ({"temperature": float("inf")}, {"top_p": float("nan")}, {"sampling_seed": 1 << 64}):
        r = httpx.post(
            url + "/generate",
            content=f'{{"input_ids": [1, 2], "sampling_params": {_json(bad)}}}',
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, (bad, r.text)
    # paused, nothing leaves the queue: two samples fill it, the next request is refused with 503
    httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30).raise_for_status()
    queued = [
        threading.Thread(
            target=_post,
            args=(url, {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}, 120),
        )
        for _ in range(2)
    ]
    for t in queued:
        t.start()
    _wait_until(lambda: _queued(url) == 2)
    full = _post(url, {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}})
    assert full.status_code == 503 and "queue is full" in full.json()["error"]["message"]
    assert full.headers["retry-after"] == "1"
    httpx.post(url + "/continue_generation", json={}, timeout=30).raise_for_status()
    for t in queued:
        t.join(60)
    assert _post(url, {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def _wait_until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition()


def _json(params: dict) -> str:
    """Python's JSON, which writes (and FastAPI's parser reads) NaN, Infinity and big ints."""
    import json

    return json.dumps(params)


def test_a_client_that_disconnects_has_its_request_aborted(small_engine):
    """Paused, a request waits in the queue for as long as its client does; when the client gives up, the
    engine drops it (without that it would wait there until the engine continued)."""
    url = small_engine
    httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30).raise_for_status()
    try:
        with pytest.raises(httpx.ReadTimeout):
            _post(url, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 8}}, timeout=1.0)
        _wait_until(lambda: _queued(url) == 0, 10)
    finally:
        httpx.post(url + "/continue_generation", json={}, timeout=30).raise_for_status()


def test_a_failing_step_fails_its_requests_and_exits_non_zero(tiny_model_dir, tmp_path):
    """Weights full of NaN (a diverged trainer) make sampling raise inside the batching loop."""
    proc, url = start_engine(tiny_model_dir, tmp_path, "--weight-sync-timeout-s", "10")
    try:
        poisoned = load_causal_lm(tiny_model_dir)[0].state_dict()
        poisoned["lm_head.weight"] = torch.full_like(poisoned["lm_head.weight"], math.nan)
        with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
            port = int(url.rsplit(":", 1)[1])
            dcs.register(NodeRegistration(role="engine", host="127.0.0.1", ports={"http": port}, run_id="nan"))
            trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="nan"))
            publisher = WeightPublisher(
                dcs,
                trainer.node_id,
                "127.0.0.1",
                timeout_s=20,
                receiver_roles=["engine"],
                pause_mode="in_place",
                run_id="nan",
            )
            assert publisher.publish(poisoned.items(), 1).ok
            publisher.close()
        r = _post(url, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}})
        assert r.status_code == 200
        reason = r.json()["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "engine error" in reason["message"]
        deadline = time.monotonic() + 60
        while proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.proc.poll() == 1  # exits non-zero: restarted by its supervisor, never a silent hang
        assert "stopped on an error" in proc.log_tail()
    finally:
        proc.stop()
