"""SGLang's /release_memory_occupation and /resume_memory_occupation on the built-in engine, as its own process
with a token: release frees the KV pool and the weights (reported by /server_info and /metrics), /generate and
weight updates are refused while released, release is refused while requests run, resume gives the memory
back (the KV pool empty, the weights zero-filled until an update), and afterwards the engine generates the
same greedy tokens as before."""

from __future__ import annotations

import json
import math
import os
import threading

import httpx
import pytest
import torch

from tests.engine.conftest import start_engine

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # an engine process end to end; ./dev test runs it

TOKEN = "memory-s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PROMPT = [11, 22, 33]
ALL = ["kv_cache", "weights", "cuda_graph"]
# long enough that a pause sent after the first streamed tokens lands mid-request (the tiny model's context
# is 2048)
LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(tiny_model_dir, tmp_path_factory):
    proc, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine-memory"), token=TOKEN)
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        yield client
    proc.stop()


def _greedy(http: httpx.Client, prompt: list[int] = PROMPT, n: int = 8) -> dict:
    r = http.post(
        "/generate",
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def _memory(http: httpx.Client) -> dict:
    return http.get("/server_info").json()["memory_occupation"]


def _gauges(http: httpx.Client) -> dict[str, float]:
    lines = http.get("/metrics").text.splitlines()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in lines
        if line.startswith(("sluice_engine_memory_bytes{", "sluice_engine_memory_released{"))
    }


def _call(http: httpx.Client, route: str, tags: list[str] | None = None, method: str = "POST") -> httpx.Response:
    return http.request(method, route, json={} if tags is None else {"tags": tags})


def _reload(http: httpx.Client, model_dir: str) -> httpx.Response:
    return http.post("/update_weights_from_disk", json={"model_path": model_dir})


class _Streaming:
    """A streaming generate on a thread; `started` is set once its first tokens arrived, so the test acts
    while it is certainly decoding."""

    def __init__(self, http: httpx.Client, **body):
        self.started, self.chunks = threading.Event(), []
        self.thread = threading.Thread(target=self._run, args=(http, {**body, "stream": True}))
        self.thread.start()

    def _run(self, http, body):
        with http.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    self.started.set()

    def result(self) -> dict:
        self.thread.join(120)
        return self.chunks[-1]


def test_release_frees_memory_refuses_work_and_resume_serves_the_same_tokens(http, tiny_model_dir):
    before, held = _greedy(http), _memory(http)
    assert held["released"] == [] and held["weights_bytes"] > 0 and held["kv_cache_bytes"] > 0
    r = _call(http, "/release_memory_occupation")  # no tags: all three, as SGLang's
    assert r.status_code == 200 and r.json() is None, r.text
    assert _memory(http) == {"released": ALL, "weights_bytes": 0, "kv_cache_bytes": 0, "device_reserved_bytes": None}
    gauges = _gauges(http)
    assert gauges['sluice_engine_memory_bytes{region="weights"}'] == 0
    assert gauges['sluice_engine_memory_bytes{region="kv_cache"}'] == 0
    assert all(gauges[f'sluice_engine_memory_released{{tag="{t}"}}'] == 1 for t in ALL)

    # while released: generation is refused at once (SGLang would run a forward over freed memory)
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503 and "/resume_memory_occupation" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 503
    assert http.get("/health_generate").status_code == 503 and http.get("/health").status_code == 200
    # so are weight updates while the weights are released, and a second release of the same tag
    r = _reload(http, tiny_model_dir)
    assert r.status_code == 400 and not r.json()["success"] and "released" in r.json()["message"]
    r = _call(http, "/release_memory_occupation", ["kv_cache"])
    assert r.status_code == 400 and "already released: kv_cache" in r.json()["error"]["message"]
    r = _call(http, "/resume_memory_occupation", ["swap_space"])
    assert r.status_code == 400 and "tags" in r.json()["error"]["message"]
    assert _memory(http)["released"] == ALL

    # the RL order: weights back, the trainer's weights in, then the KV cache
    assert _call(http, "/resume_memory_occupation", ["weights"], method="GET").status_code == 200
    memory = _memory(http)
    assert memory["released"] == ["kv_cache", "cuda_graph"] and memory["weights_bytes"] == held["weights_bytes"]
    assert http.post("/generate", json={"input_ids": PROMPT}).status_code == 503  # the KV pool is still away
    r = _reload(http, tiny_model_dir)
    assert r.status_code == 200 and r.json()["success"], r.text
    r = _call(http, "/resume_memory_occupation")  # all three, but weights are back already: nothing changes
    assert r.status_code == 400 and "not released: weights" in r.json()["error"]["message"]
    assert _memory(http)["released"] == ["kv_cache", "cuda_graph"]
    assert _call(http, "/resume_memory_occupation", ["cuda_graph", "kv_cache"]).status_code == 200
    assert _memory(http) == held
    after = _greedy(http)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_resumed_weights_are_zeros_until_an_update_loads_weights(http, tiny_model_dir):
    before = _greedy(http)
    assert _call(http, "/release_memory_occupation", ["weights"]).status_code == 200
    assert _memory(http)["kv_cache_bytes"] > 0  # only what was asked for is released
    assert _call(http, "/resume_memory_occupation", ["weights"]).status_code == 200
    zeros = _greedy(http)
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    # every logit 0: greedy picks the first id, each with log-probability -log(vocab size)
    assert zeros["output_ids"] == [0] * 8
    logprobs = [entry[0] for entry in zeros["meta_info"]["output_token_logprobs"]]
    assert all(math.isclose(lp, -math.log(vocab), rel_tol=1e-5) for lp in logprobs), logprobs
    assert _reload(http, tiny_model_dir).json()["success"]
    assert _greedy(http)["output_ids"] == before["output_ids"]


def test_release_needs_an_idle_engine_and_a_retracted_request_finishes_after_resume(http):
    full = http.post("/generate", json={"input_ids": [7, 8, 9], "sampling_params": LONG}).json()["output_ids"]
    req = _Streaming(http, input_ids=[7, 8, 9], sampling_params=LONG)
    assert req.started.wait(60)
    r = _call(http, "/release_memory_occupation", ["kv_cache"])
    assert r.status_code == 400 and "1 running" in r.json()["error"]["message"]
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    r = _call(http, "/release_memory_occupation", ["kv_cache"])  # a frozen request holds its KV
    assert r.status_code == 400 and "1 frozen" in r.json()["error"]["message"]
    assert _memory(http)["released"] == []
    assert http.post("/continue_generation").status_code == 200
    # retract: the request goes back to the queue without KV; a paused engine may release with it waiting
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    assert _call(http, "/release_memory_occupation", ["kv_cache"]).status_code == 200
    assert _memory(http)["kv_cache_bytes"] == 0 and req.thread.is_alive()
    assert http.post("/continue_generation").status_code == 200  # no step runs until the KV pool is back
    assert http.post("/generate", json={"input_ids": PROMPT}).status_code == 503
    assert req.thread.is_alive()
    assert _call(http, "/resume_memory_occupation", ["kv_cache"]).status_code == 200
    last = req.result()
    assert last["output_ids"] == full and last["meta_info"]["finish_reason"]["type"] == "length"


def test_release_and_resume_need_the_token(http):
    for route in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = httpx.post(str(http.base_url).rstrip("/") + route, json={})
        assert r.status_code == 401, r.text
    assert _memory(http)["released"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the engine's GPU path cannot run here")
def test_on_a_gpu_released_memory_goes_back_to_the_device(tiny_model_dir, tmp_path):
    proc, url = start_engine(tiny_model_dir, tmp_path, "--device", "cuda", token=TOKEN)
    try:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as gpu:
            before, held = _greedy(gpu), _memory(gpu)
            assert _call(gpu, "/release_memory_occupation").status_code == 200
            released = _memory(gpu)
            assert released["weights_bytes"] == 0 and released["kv_cache_bytes"] == 0
            # PyTorch's cache was emptied: the pool's own segments are the device's again
            assert released["device_reserved_bytes"] <= held["device_reserved_bytes"] - held["kv_cache_bytes"]
            assert _call(gpu, "/resume_memory_occupation", ["weights"]).status_code == 200
            assert _reload(gpu, tiny_model_dir).json()["success"]
            assert _call(gpu, "/resume_memory_occupation", ["kv_cache", "cuda_graph"]).status_code == 200
            resumed = _memory(gpu)
            assert resumed["released"] == [] and resumed["kv_cache_bytes"] == held["kv_cache_bytes"]
            assert _greedy(gpu)["output_ids"] == before["output_ids"]
    finally:
        proc.stop()
