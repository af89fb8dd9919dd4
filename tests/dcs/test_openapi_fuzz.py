"""Fuzzing the coordinator's HTTP API against the real process (issue #13): schemathesis over its OpenAPI
(valid and invalid inputs), and JSON bodies with NaN / Infinity in every numeric field (which Python's
JSON parser reads, and schemathesis never sends). No input makes it answer 5xx, and a rejected call leaves
every Redis key as it was.

tests/openapi_numbers.py builds the number cases for any OpenAPI document; the engine's fuzz test uses it too."""

from __future__ import annotations

import collections

import httpx
import pytest
import redis
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from services.dcs.local import LocalDCS
from tests.openapi_numbers import EXTREME, EXTREME_TEXT, NON_FINITE, NON_FINITE_TEXT, names_field, number_cases
from tests.redis_state import changed_keys, redis_digest

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # several processes end to end; ./dev test runs it

RUN = {"name": "fz", "model": "/m"}


@pytest.fixture(scope="module")
def dcs(tmp_path_factory):
    """A coordinator with a run `fz` and a trainer node of it (long lease: nothing expires while fuzzing)."""
    with LocalDCS(log_dir=str(tmp_path_factory.mktemp("dcs-fuzz")), args=("--node-lease-s", "3600")) as local:
        httpx.post(local.url + "/v1/runs", json=RUN, timeout=10).raise_for_status()
        node = httpx.post(
            local.url + "/v1/nodes", json={"role": "trainer", "host": "127.0.0.1", "run_id": "fz"}, timeout=10
        )
        node.raise_for_status()
        client = redis.Redis.from_url(local.redis_url)
        yield local, client, node.json()["node_id"]
        client.close()


def _strategy(operation):
    """Valid inputs and, where the operation has anything to get wrong, invalid ones."""
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    if operation.body or operation.query or operation.path_parameters:
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(strategies)


def test_no_input_causes_a_server_error_or_a_rejected_change(dcs):
    """Valid and invalid inputs of every operation: never a 5xx, and a refused call changes no Redis key."""
    local, client, _ = dcs
    schema = schemathesis.openapi.from_url(local.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    failures, statuses, session = [], collections.Counter(), requests.Session()
    for operation in operations:

        @given(case=_strategy(operation))
        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            if case.path == "/v1/runs/{run_id}/weights/next" and isinstance(case.query, dict):
                case.query["wait_s"] = 0  # do not long-poll (the only call that legitimately waits)
            before = redis_digest(client)
            response = case.call(base_url=local.url, session=session, timeout=10)
            statuses[response.status_code] += 1
            where = (case.method, case.formatted_path, response.status_code, response.text[:200])
            if response.status_code >= 500:
                failures.append(("5xx", *where))
            elif response.status_code >= 400 and (after := redis_digest(client)) != before:
                failures.append(("rejected, yet changed", changed_keys(before, after), *where))

        fuzz()
    print(f"\ncoordinator schemathesis: {sum(statuses.values())} calls, statuses {dict(sorted(statuses.items()))}")
    assert failures == []
    assert sum(statuses.values()) >= 300 and statuses[422] > 0 and statuses[200] > 0
    assert local.proc.alive()


@pytest.fixture
def http(dcs):
    """JSON calls to the coordinator on one connection (a client per call costs ~30 ms)."""
    with httpx.Client(base_url=dcs[0].url, headers={"content-type": "application/json"}, timeout=10) as client:
        yield client


def test_non_finite_numbers_are_refused_and_change_nothing(dcs, http):
    """Every numeric field of every request body, as NaN, Infinity and -Infinity: 422 naming the field,
    and not a key of Redis touched; numeric query and path parameters likewise (4xx)."""
    local, client, node_id = dcs
    spec = httpx.get(local.url + "/openapi.json", timeout=10).json()
    cases = number_cases(spec, {"run_id": "fz", "node_id": node_id, "role": "trainer"}, NON_FINITE, NON_FINITE_TEXT)
    fields = {(c.method, c.path.split("/")[-1], c.field[-1]) for c in cases}
    for expected in (
        ("POST", "nodes", "rank"),
        ("POST", "heartbeat", "step"),
        ("POST", "weights", "offset"),
        ("POST", "syncs", "metadata"),
        ("POST", "runs", "lr"),
        ("GET", "next", "wait_s"),
    ):
        assert expected in fields, expected
    before, statuses, failures = redis_digest(client), collections.Counter(), []
    for case in cases:
        r = http.request(case.method, case.path, params=case.query, content=case.content)
        statuses[r.status_code] += 1
        if case.body is not None:
            refused = r.status_code == 422 and names_field([e["loc"][1:] for e in r.json()["detail"]], case.field)
        else:
            refused = 400 <= r.status_code < 500
        if not refused or redis_digest(client) != before:
            failures.append((case.method, case.path, case.field, case.value, r.status_code, r.text[:200]))
    print(f"\ncoordinator non-finite: {len(cases)} calls, statuses {dict(sorted(statuses.items()))}")
    assert failures == []
    assert local.proc.alive()


def test_extreme_numbers_never_cause_a_server_error(dcs, http):
    """Every numeric field and parameter at or past the edges of int64 and float64: accepted where in bounds,
    otherwise refused without a change; never a 5xx."""
    local, client, node_id = dcs
    spec = httpx.get(local.url + "/openapi.json", timeout=10).json()
    cases = number_cases(spec, {"run_id": "fz", "node_id": node_id, "role": "trainer"}, EXTREME, EXTREME_TEXT)
    statuses, failures = collections.Counter(), []
    for case in cases:
        before = redis_digest(client)
        r = http.request(case.method, case.path, params=case.query, content=case.content)
        statuses[r.status_code] += 1
        if r.status_code >= 500 or (r.status_code >= 400 and redis_digest(client) != before):
            failures.append((case.method, case.path, case.field, case.value, r.status_code, r.text[:200]))
    print(f"\ncoordinator extreme numbers: {len(cases)} calls, statuses {dict(sorted(statuses.items()))}")
    assert failures == []
    assert local.proc.alive() and statuses[422] > 0
