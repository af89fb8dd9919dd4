"""The built-in engine, as its own process, against the model's own teacher-forced forward."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from services.model.loading import load_causal_lm

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)[0]


def _teacher_forced(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def _gen(url: str, **body) -> dict | list:
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


TEMPERATURES = [1.0, 0, 0.7, 0]


def test_logprobs_equal_teacher_forcing_with_requests_joining_mid_flight(engine, reference):
    prompts = [[5, 17, 300, 2, 9], [44, 9], [100, 200, 300, 400, 500, 600, 700], [3]]
    results = {}

    def run(i, delay):
        time.sleep(delay)  # later requests join while earlier ones decode
        params = {"max_new_tokens": 24, "temperature": TEMPERATURES[i], "sampling_seed": i, "ignore_eos": True}
        results[i] = _gen(engine, input_ids=prompts[i], sampling_params=params, return_logprob=True)

    threads = [threading.Thread(target=run, args=(i, 0.05 * i)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, p in enumerate(prompts):
        out = results[i]
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        # sampled: log-probs of the temperature-scaled distribution; greedy: of the raw logits
        ref = _teacher_forced(reference, p, out["output_ids"], TEMPERATURES[i] or 1.0)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-5
        assert out["meta_info"]["completion_tokens"] == 24 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_greedy_equals_transformers_generate(engine, reference, tiny_model_dir):
    prompt = [12, 34, 56, 78]
    out = _gen(engine, input_ids=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    ref = reference.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert out["output_ids"] == ref


def test_same_seed_same_samples_and_n(engine):
    body = dict(
        text="What is 3 + 4?",
        sampling_params={"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 42, "n": 3, "ignore_eos": True},
    )
    a, b = _gen(engine, **body), _gen(engine, **body)
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    assert len({tuple(x["output_ids"]) for x in a}) > 1  # the n children differ


def test_stop_conditions_and_streaming(engine):
    out = _gen(
        engine, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    )
    third = out["output_ids"][2]
    stopped = _gen(
        engine,
        input_ids=[1, 2, 3],
        sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "stop_token_ids": [third]},
    )
    assert stopped["output_ids"] == out["output_ids"][:3]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    with httpx.stream(
        "POST",
        engine + "/generate",
        json={
            "input_ids": [1, 2, 3],
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["output_ids"] == out["output_ids"][:5]  # the ids so far in each event, as SGLang's
    assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])] for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "body",
    [
        {"text": "a", "input_ids": [1]},
        {"input_ids": []},
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        {"text": "a", "sampling_params": {"temperature": "hot"}},
        {"text": "a", "sampling_params": {"bogus_key": 1}},
        {"input_ids": [10**9]},
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(engine, body):
    r = httpx.post(engine + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert httpx.get(engine + "/health").status_code == 200


def test_a_body_that_does_not_validate_gets_a_message_naming_the_field(engine):
    r = httpx.post(
        engine + "/generate", json={"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, timeout=30
    )
    assert r.status_code == 400 and "sampling_params" in r.json()["error"]["message"]
    assert "temperature" in r.json()["error"]["message"]
    for raw in (b"{not json", b"", b"[1, 2]", b"null"):
        r = httpx.post(engine + "/generate", content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"], raw


class _Streaming:
    """A streaming generate on a thread; `started` is set once the first tokens arrived, so a test
    acts while the request is certainly decoding (no timing guesses)."""

    def __init__(self, url: str, **body):
        self.started = threading.Event()
        self.chunks: list[dict] = []
        self.thread = threading.Thread(target=self._run, args=(url, body))
        self.thread.start()

    def _run(self, url, body):
        with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    self.started.set()

    def result(self) -> tuple[list[int], dict]:
        self.thread.join(120)
        return self.chunks[-1]["output_ids"], self.chunks[-1]["meta_info"]  # each event: the ids so far


# long enough that a pause or abort sent after the first streamed tokens lands mid-request on a fast engine
# (the tiny model's context is 2048)
LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}


def test_pause_modes_under_load(engine):
    # abort: in-flight requests end at once with partial output
    req = _Streaming(engine, input_ids=[7, 8, 9], sampling_params=LONG)
    assert req.started.wait(30)
    assert httpx.post(engine + "/pause_generation", json={"mode": "abort"}).status_code == 200
    ids, meta = req.result()
    assert meta["finish_reason"]["type"] == "abort" and 0 < len(ids) < 2000
    # while paused, a new request is held open
    held = {}
    h = threading.Thread(
        target=lambda: held.update(
            r=_gen(engine, input_ids=[1], sampling_params={"max_new_tokens": 3, "temperature": 0})
        )
    )
    h.start()
    time.sleep(0.5)
    assert h.is_alive() and "r" not in held
    assert httpx.post(engine + "/continue_generation", json={}).status_code == 200
    h.join(30)
    assert held["r"]["meta_info"]["completion_tokens"] >= 1
    # in_place and retract: the request survives the pause and finishes whole, same tokens as unpaused
    body = LONG
    full = _gen(engine, input_ids=[7, 8, 9], sampling_params=body)
    for mode in ("in_place", "retract"):
        req = _Streaming(engine, input_ids=[7, 8, 9], sampling_params=body)
        assert req.started.wait(30)
        assert httpx.post(engine + "/pause_generation", json={"mode": mode}).status_code == 200
        time.sleep(0.2)
        assert req.thread.is_alive()
        assert httpx.post(engine + "/flush_cache").status_code == 400  # busy
        assert httpx.post(engine + "/continue_generation", json={}).status_code == 200
        ids, meta = req.result()
        assert ids == full["output_ids"], mode
        assert meta["finish_reason"]["type"] == "length"
    assert httpx.post(engine + "/flush_cache").status_code == 200


def _steps(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("sluice_engine_steps "))
    return float(line.split()[1])


def test_greedy_requests_draft_from_earlier_ones_until_the_cache_is_flushed(engine):
    body = {
        "input_ids": [31, 32, 33, 34],
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
    }

    def steps_of_one() -> tuple[float, list[int]]:
        before = _steps(engine)
        out = _gen(engine, **body)["output_ids"]
        return _steps(engine) - before, out

    assert httpx.post(engine + "/flush_cache").status_code == 200
    cold, first = steps_of_one()
    warm, again = steps_of_one()  # drafts its whole output from the first request's context
    assert httpx.post(engine + "/flush_cache").status_code == 200
    flushed, last = steps_of_one()
    assert first == again == last
    assert warm < cold and flushed == cold


def test_abort_request_by_rid_prefix(engine):
    req = _Streaming(engine, input_ids=[4, 5], rid="job-7", sampling_params={**LONG, "temperature": 1.0})
    other = _Streaming(engine, input_ids=[4, 5], rid="keep-1", sampling_params={**LONG, "max_new_tokens": 200})
    assert req.started.wait(30) and other.started.wait(30)
    httpx.post(engine + "/abort_request", json={"rid": "job"})
    ids, meta = req.result()
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "job-7"
    ids, meta = other.result()
    assert meta["finish_reason"]["type"] == "length" and len(ids) == 200  # unmatched prefix: untouched


def test_stop_strings_cut_the_text(engine):
    out = _gen(
        engine, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    )
    text = out["text"]
    assert text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    cut = _gen(
        engine,
        input_ids=[1, 2, 3],
        sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [needle]},
    )
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": needle}
    assert needle not in cut["text"] and text.startswith(cut["text"])


def test_prompt_and_top_logprobs(engine, reference):
    prompt = [9, 8, 7, 6, 5]
    out = _gen(
        engine,
        input_ids=prompt,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    meta = out["meta_info"]
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt + out["output_ids"]])).logits[0], dim=-1)
    inputs = meta["input_token_logprobs"]
    assert [x[1] for x in inputs] == prompt and inputs[0][0] is None
    for i in range(1, len(prompt)):
        assert abs(inputs[i][0] - float(logprobs[i - 1, prompt[i]])) < 1e-5
    for step, top in enumerate(meta["output_top_logprobs"]):
        ref = torch.topk(logprobs[len(prompt) - 1 + step], 3)
        assert [t[1] for t in top] == ref.indices.tolist()
        assert top[0][1] == out["output_ids"][step]  # greedy picks the top token
    assert (
        "input_token_logprobs"
        not in _gen(engine, input_ids=prompt, return_logprob=True, sampling_params={"max_new_tokens": 1})["meta_info"]
    )


def test_a_group_in_one_batch_request_prefills_its_prompt_once(engine, reference):
    """A rollout sends a GRPO group as one batch of the same prompt (one seed and rid each): the prompt is
    computed once and copied (cached_tokens), and every sample is still exact and reproducible."""
    prompt = [7, 70, 700, 17, 170]
    body = dict(
        input_ids=[prompt] * 4,
        rid=[f"grp-{k}" for k in range(4)],
        return_logprob=True,
        sampling_params=[
            {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 100 + k, "ignore_eos": True} for k in range(4)
        ],
    )
    first, again = _gen(engine, **body), _gen(engine, **body)
    assert sorted(r["meta_info"]["cached_tokens"] for r in first) == [0, 5, 5, 5]
    assert [r["meta_info"]["id"] for r in first] == [f"grp-{k}" for k in range(4)]
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    assert len({tuple(r["output_ids"]) for r in first}) > 1
    for r in first:
        lps = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        ref = _teacher_forced(reference, prompt, r["output_ids"])
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-5
    # sampling_params.n names the children rid-i and shares the prompt the same way
    n = _gen(engine, input_ids=prompt, rid="nn", sampling_params={"max_new_tokens": 4, "n": 3, "temperature": 1.0})
    assert [r["meta_info"]["id"] for r in n] == ["nn-0", "nn-1", "nn-2"]
    assert sorted(r["meta_info"]["cached_tokens"] for r in n) == [0, 5, 5]


def test_client_errors_name_the_endpoint_and_tell_unreachable_from_refused(engine):
    """The rollout's client: an engine that does not answer is EngineUnreachable (retryable); one that
    answers with an error is an SGLangError with its status and message; a good call returns samples."""
    import asyncio

    from services.sglang_protocol.client import EngineUnreachable, SGLangClient, SGLangError
    from services.runtime.processes import free_port

    async def calls():
        good = SGLangClient(engine, timeout_s=10)
        dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=2)
        try:
            out = await good.generate_batch([[5, 6, 7]] * 2, [{"temperature": 0, "max_new_tokens": 3}] * 2)
            assert [len(g.output_ids) for g in out] == [3, 3] and all(len(g.log_probs) == 3 for g in out)
            with pytest.raises(SGLangError) as refused:
                await good.generate_batch([[5, 6, 7]], [{"temperature": -1.0, "max_new_tokens": 3}])
            assert refused.value.status == 400 and not isinstance(refused.value, EngineUnreachable)
            with pytest.raises(EngineUnreachable) as unreachable:
                await dead.generate_batch([[5, 6, 7]], [{"max_new_tokens": 3}])
            assert unreachable.value.endpoint == "/generate"
        finally:
            await good.aclose()
            await dead.aclose()

    asyncio.run(calls())


# Request bodies as slime's and AReaL's rollouts build them for SGLang's /generate (field for field; values made
# up): the engine serves them as SGLang does, ignoring the keys it does not know and honouring the ones it does.
SLIME_BODY = {
    "input_ids": [5, 6, 7],
    "return_logprob": True,
    "sampling_params": {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 6,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    },
}
AREAL_BODY = {
    "input_ids": [5, 6, 7],
    "image_data": None,
    "return_logprob": True,
    "stream": False,
    "sampling_params": {
        "top_p": 1.0,
        "top_k": 100000000,
        "max_new_tokens": 6,
        "temperature": 0.0,
        "stop_token_ids": [2],
        "frequency_penalty": 0.0,
        "ignore_eos": True,
    },
    "lora_path": None,
    "some_future_key": {"ignored": True},
}


@pytest.mark.parametrize("body", [SLIME_BODY, AREAL_BODY], ids=["slime", "areal"])
def test_request_bodies_of_sglang_clients_are_served(engine, body):
    out = _gen(engine, **body)
    assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) <= 6


@pytest.mark.parametrize(
    "body,names",
    [
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
        ({"input_ids": [1], "image_data": "http://x/y.png"}, "image_data"),
        ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [[1], [2]], "return_logprob": [True]}, "one return_logprob per input"),
    ],
)
def test_what_sglang_serves_and_this_engine_does_not_is_refused_by_name(engine, body, names):
    r = httpx.post(engine + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and names in r.json()["error"]["message"], r.text


def test_log_probs_may_be_asked_for_per_input(engine):
    out = _gen(
        engine,
        input_ids=[[1, 2], [3, 4, 5]],
        return_logprob=[False, True],
        top_logprobs_num=[0, 2],
        sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert "output_token_logprobs" not in out[0]["meta_info"] or out[0]["meta_info"]["output_token_logprobs"] is None
    assert len(out[1]["meta_info"]["output_token_logprobs"]) == 3
    assert all(len(top) == 2 for top in out[1]["meta_info"]["output_top_logprobs"])


def test_sglangs_other_routes_health_generate_and_update_weight_version(engine):
    assert httpx.get(engine + "/health_generate", timeout=60).status_code == 200  # one token through the scheduler
    before = httpx.get(engine + "/weight_version").json()["weight_version"]
    running = _Streaming(engine, input_ids=[4, 5, 6], sampling_params=LONG)
    assert running.started.wait(30)
    r = httpx.post(engine + "/update_weight_version", json={"new_version": "v-set", "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["success"]
    ids, meta = running.result()
    assert meta["finish_reason"]["type"] == "abort" and 0 < len(ids) < LONG["max_new_tokens"]
    assert httpx.get(engine + "/weight_version").json()["weight_version"] == "v-set"
    info = httpx.get(engine + "/server_info").json()
    assert info["dtype"] == "float32" and info["tp_size"] == 1 and info["weight_version"] == "v-set"
    assert httpx.post(engine + "/update_weight_version", json={"new_version": before}).status_code == 200
