"""Fuzzing the built-in engine's HTTP API, as its own process with a token (issue #13): schemathesis over
its OpenAPI (valid and invalid inputs) and JSON bodies with NaN / Infinity in every numeric field. No
input makes it answer 5xx or die, a rejected call changes nothing (weight version, queue, running requests,
KV slots), and afterwards it still generates."""

from __future__ import annotations

import collections
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from services.runtime.processes import free_port
from tests.openapi_numbers import EXTREME, EXTREME_TEXT, NON_FINITE, NON_FINITE_TEXT, names_field, number_cases
from tests.engine.conftest import start_engine

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # an engine process end to end; ./dev test runs it

TOKEN = "fuzz-s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
EXAMPLES_PER_OPERATION = 30
# fewer for joining a weight-update group: its valid cases each wait most of a second for a rendezvous that
# never answers
EXAMPLES = {"/init_weights_update_group": 12}
SERVABLE_EXAMPLES = 60  # valid /generate bodies made servable (_servable), on top of its 30
MAX_NEW_TOKENS = 4
GAUGES = ("sluice_engine_running_requests", "sluice_engine_waiting_requests", "sluice_engine_kv_slots_used")


@pytest.fixture(scope="module")
def fuzzed_engine(tiny_model_dir, tmp_path_factory):
    """Small limits keep every generated request short: at most 4 new tokens, a 64-token context and 8 queued
    samples (a bigger ask is a 400); a weight-update group that cannot be joined fails in under a second."""
    proc, url = start_engine(
        tiny_model_dir,
        tmp_path_factory.mktemp("engine-fuzz"),
        "--context-length",
        "64",
        "--max-new-tokens-limit",
        str(MAX_NEW_TOKENS),
        "--max-running",
        "2",
        "--max-queued-requests",
        "8",
        "--weight-sync-timeout-s",
        "0.1",
        token=TOKEN,
    )
    # one connection for the test's own calls (a client per call costs ~30 ms)
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        yield proc, url, http
    proc.stop()


def _state(http: httpx.Client) -> tuple:
    """What a rejected call must leave as it was: the weight version and the scheduler's gauges."""
    version = http.get("/weight_version").json()["weight_version"]
    gauges = tuple(line for line in http.get("/metrics").text.splitlines() if line.split(" ")[0] in GAUGES)
    assert len(gauges) == len(GAUGES)
    return version, gauges


def _unchanged(http: httpx.Client, baseline: tuple) -> bool:
    """Whether the state is (back) at `baseline` within 10 s: a finished request's answer can reach its
    client a moment before the engine thread drops it from the running list at the end of its step."""
    deadline = time.monotonic() + 10.0
    while (state := _state(http)) != baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return state == baseline


def _generates(http: httpx.Client) -> bool:
    r = http.post(
        "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}},
    )
    return r.status_code == 200 and len(r.json()["output_ids"]) == MAX_NEW_TOKENS


def _locations(message: str) -> list[list[str]]:
    """The fields a 400's message names: it reads `a.b.0: why; c: why` (server.py)."""
    return [part.split(": ", 1)[0].split(".") for part in message.split("; ")]


def _bounded(case, closed_port: int) -> None:
    """Keep a generated call from legitimately blocking for long; only values that pass validation change,
    so the invalid ones are still sent as generated."""
    query = case.query or {}
    if "wait_s" in query:  # a long poll of /weight_version waits up to wait_s (60 s) for a new version
        try:
            if 0 < float(query["wait_s"]) <= 60:
                query["wait_s"] = 0.01
        except (TypeError, ValueError):
            pass
    body = case.body if isinstance(case.body, dict) else {}
    if case.path == "/init_weights_update_group":
        # joining a group connects to master_address:master_port for up to --weight-sync-timeout-s; a
        # random host name would first wait on DNS (unbounded by the engine) and a random port could be some
        # other test's live rendezvous: a valid address becomes a local port nobody listens on
        if isinstance(body.get("master_address"), str) and 1 <= len(body["master_address"]) <= 255:
            body["master_address"] = "127.0.0.1"
        port = body.get("master_port")  # an integer, or a float that is one (12.0)
        if type(port) in (int, float) and float(port).is_integer() and 1 <= port <= 65535:
            body["master_port"] = closed_port


def _servable(case):
    """A generated /generate body made one the engine serves (ids in the vocabulary, short prompts, at most
    two of them with two samples each), so its random sampling settings reach the sampler, not only the
    validation (a valid body as generated is almost never servable: ids past the vocabulary, text and ids)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    body.pop("text", None)
    ids = body.get("input_ids") or [1]
    prompts = [[i % 1000 for i in p][:16] or [1] for p in (ids if isinstance(ids[0], list) else [ids])][:2]
    body["input_ids"] = prompts if isinstance(ids[0], list) else prompts[0]
    params = body.get("sampling_params") or {}  # absent: the default max_new_tokens is over the limit
    if isinstance(params, list):  # one per prompt, or else one for all
        params = params[: len(prompts)] if len(params) >= len(prompts) else (params or [{}])[0]
    body["sampling_params"] = params
    for p in params if isinstance(params, list) else [params]:
        p["max_new_tokens"] = p.get("max_new_tokens", 1) % (MAX_NEW_TOKENS + 1)
        p["n"] = 1 + (p.get("n", 1) - 1) % 2
        p["top_k"] = p["top_k"] if p.get("top_k", -1) > 0 else -1
    for key, default, bound in (("top_logprobs_num", 0, 8), ("logprob_start_len", -1, 16)):
        value = body.get(key, default)  # one for all inputs or one each (SGLang's); None: the default
        values = value if isinstance(value, list) else [default if value is None else value]
        values = [v % bound if isinstance(v, int) and v >= 0 else default for v in values] or [default]
        body[key] = values[: len(prompts)] if isinstance(value, list) and len(values) >= len(prompts) else values[0]
    if isinstance(body.get("return_logprob"), list):
        flags = body["return_logprob"]
        body["return_logprob"] = flags[: len(prompts)] if len(flags) >= len(prompts) else bool(flags and flags[0])
    if isinstance(body.get("rid"), list) and len(body["rid"]) != len(prompts):
        del body["rid"]
    return case


def _plans(operations) -> list:
    """(operation, strategy, examples): each operation's valid and, where it has anything to get wrong,
    invalid inputs; then valid /generate bodies made servable."""
    plans = []
    for operation in operations:
        strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
        if operation.body or operation.query or operation.path_parameters:
            strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
        plans.append((operation, st.one_of(strategies), EXAMPLES.get(operation.path, EXAMPLES_PER_OPERATION)))
        if operation.path == "/generate":
            plans.append((operation, strategies[0].map(_servable), SERVABLE_EXAMPLES))
    return plans


def _resume(http: httpx.Client, model_dir: str) -> None:
    """Every released tag resumed, the model's weights loaded again (resumed weights are zeros)."""
    released = http.get("/server_info").json()["memory_occupation"]["released"]
    http.post("/resume_memory_occupation", json={"tags": released}).raise_for_status()
    if "weights" in released:
        assert http.post("/update_weights_from_disk", json={"model_path": model_dir}).json()["success"]


def test_no_generated_input_causes_a_server_error_or_changes_state(fuzzed_engine, tiny_model_dir):
    """Valid and invalid inputs of every route (and servable /generate bodies): never a 5xx, the process lives,
    a refused call changes nothing, and afterwards the engine generates with its initial weights."""
    proc, url, http = fuzzed_engine
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/generate",
        "/pause_generation",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/weight_version",
    }
    closed_port, statuses, served, failures = free_port(), collections.Counter(), collections.Counter(), []
    session = requests.Session()
    baseline = _state(http)
    for operation, strategy, examples in _plans(operations):

        @given(case=strategy)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            _bounded(case, closed_port)
            response = case.call(base_url=url, session=session, headers=AUTH, timeout=30)
            statuses[response.status_code] += 1
            served[case.path] += response.status_code == 200
            where = (case.method, case.path, response.status_code, response.text[:200])
            if response.status_code >= 500:
                failures.append(("5xx", *where))
            if case.path == "/pause_generation" and response.status_code == 200:
                # a pause legitimately holds every later request: undo it before the next case
                http.post("/continue_generation").raise_for_status()
            elif case.path == "/release_memory_occupation" and response.status_code == 200:
                # releasing memory is that route's job: take it back and load the initial weights again
                _resume(http, tiny_model_dir)
            elif case.path == "/update_weight_version" and response.status_code == 200:
                # setting the reported version is that route's job: set it back before the next case
                http.post("/update_weight_version", json={"new_version": baseline[0]}).raise_for_status()
            elif response.status_code >= 400 and not _unchanged(http, baseline):
                failures.append(("state changed", *where))

        fuzz()
        assert proc.proc.poll() is None, f"the engine died fuzzing {operation.method} {operation.path}"
    print(
        f"\nengine schemathesis: {sum(statuses.values())} calls, statuses {dict(sorted(statuses.items()))}, "
        f"{served['/generate']} generations"
    )
    assert failures == []
    assert sum(statuses.values()) >= 250 and served["/generate"] >= 30 and statuses[400] > 0
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert _generates(http) and _unchanged(http, baseline)  # still the initial weights, nothing left running


def _cases(http: httpx.Client, values: tuple, texts: tuple) -> list:
    """The numeric fields of every body and query, in bodies the engine would serve: one input, a few new
    tokens, log-probs on, and a weight-update group on a local port nobody listens on."""
    spec = http.get("/openapi.json").json()
    bases = {
        "/generate": {
            "text": None,
            "rid": None,
            "stop": None,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 2},
        },
        "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": free_port()},
    }
    return number_cases(spec, {}, values, texts, bases)


def _send(http: httpx.Client, case) -> httpx.Response:
    return http.request(
        case.method, case.path, params=case.query, content=case.content, headers={"content-type": "application/json"}
    )


def test_non_finite_numbers_in_any_body_or_query_are_refused_and_change_nothing(fuzzed_engine):
    """Python's JSON parser (FastAPI's) reads NaN, Infinity and -Infinity: every numeric field of every
    request body gets each of them, and the answer is a 400 naming the field."""
    proc, _, http = fuzzed_engine
    cases = _cases(http, NON_FINITE, NON_FINITE_TEXT)
    assert {c.path for c in cases if c.body is not None} >= {
        "/generate",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
    }
    assert any(c.field[-1] == "temperature" for c in cases) and any(c.field[-1] == "nbytes" for c in cases)
    baseline, statuses, failures = _state(http), collections.Counter(), []
    for case in cases:
        r = _send(http, case)
        statuses[r.status_code] += 1
        if case.body is not None:  # a body field: refused with a message naming it
            refused = r.status_code == 400 and names_field(_locations(r.json()["error"]["message"]), case.field)
        else:  # a query parameter: never a server error (`/spans?since=` is only a filter: any float will do)
            refused = r.status_code < 500 and (r.status_code >= 400 or case.path == "/spans")
        if not refused or not _unchanged(http, baseline):
            failures.append((case.method, case.path, case.field, case.value, r.status_code, r.text[:200]))
    print(f"\nengine non-finite: {len(cases)} calls, statuses {dict(sorted(statuses.items()))}")
    assert failures == []
    assert proc.proc.poll() is None and _generates(http) and _unchanged(http, baseline)


def test_extreme_numbers_never_cause_a_server_error(fuzzed_engine):
    """Every numeric field and parameter at or past the edges of int64 and float64, in otherwise servable
    bodies: served where in bounds, refused where not, never a 5xx, and the engine lives on unchanged."""
    proc, _, http = fuzzed_engine
    cases = _cases(http, EXTREME, EXTREME_TEXT)
    baseline, statuses, failures = _state(http), collections.Counter(), []
    for case in cases:
        r = _send(http, case)
        statuses[r.status_code] += 1
        if r.status_code >= 500 or proc.proc.poll() is not None or not _unchanged(http, baseline):
            failures.append((case.method, case.path, case.field, case.value, r.status_code, r.text[:200]))
            if proc.proc.poll() is not None:
                break
    print(f"\nengine extreme numbers: {len(cases)} calls, statuses {dict(sorted(statuses.items()))}")
    assert failures == []
    assert statuses[200] > 0 and statuses[400] > 0 and _generates(http)
