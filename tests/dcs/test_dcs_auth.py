"""The coordinator's authentication, against a real coordinator process: every route in its OpenAPI document
(so a route added later is covered too) refuses a missing or wrong token before it runs, a refused call
changes nothing, the token comes from --auth-token-file and is not on the command line, and --metrics-port
serves /metrics without it."""

from __future__ import annotations

import re

import httpx
import pytest

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.run_contract.run_config import RunConfig
from services.runtime.processes import free_port

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

TOKEN = "dcs-s3cret-from-a-file"
AUTH = {"authorization": f"Bearer {TOKEN}"}
RUN = {
    "name": "r",
    "model": "/m",
    "n_samples_per_prompt": 2,
    "rollout_batch_size": 2,
    "global_batch_size": 4,
    "micro_batch_size": 2,
}


@pytest.fixture(scope="module")
def dcs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcs-auth")
    (tmp / "token").write_text(TOKEN + "\n")
    metrics_port = free_port()
    with LocalDCS(
        log_dir=str(tmp), args=("--auth-token-file", str(tmp / "token"), "--metrics-port", str(metrics_port))
    ) as d:
        d.metrics_port = metrics_port
        yield d


def test_every_route_refuses_a_missing_or_wrong_token(dcs):
    spec = httpx.get(dcs.url + "/openapi.json", headers=AUTH).json()
    routes = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path)) for path, ops in spec["paths"].items() for method in ops
    ]
    assert len(routes) >= 20
    for method, path in routes + [("GET", "/docs"), ("GET", "/metrics")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            r = httpx.request(method, dcs.url + path, headers=headers, json={} if method != "GET" else None)
            expected = 200 if path in ("/healthz", "/readyz") else 401
            assert r.status_code == expected, (method, path, headers, r.text)
            assert TOKEN not in r.text


def test_a_refused_call_changes_nothing(dcs):
    assert httpx.post(dcs.url + "/v1/runs", json=RUN, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(dcs.url + "/v1/runs", headers=AUTH).json() == []
    with DCSClient(dcs.url, token=TOKEN) as client:  # and the right token works
        assert client.create_run(RunConfig(**RUN)).config.name == "r"


def test_the_token_file_is_read_and_the_token_is_not_on_the_command_line(dcs):
    assert httpx.get(dcs.url + "/v1/topology", headers=AUTH).status_code == 200
    with open(f"/proc/{dcs.proc.proc.pid}/cmdline", "rb") as f:
        assert TOKEN.encode() not in f.read()


def test_the_metrics_port_serves_metrics_without_the_token(dcs):
    assert httpx.get(dcs.url + "/metrics").status_code == 401
    assert "sluice_dcs_http_total" in httpx.get(f"http://127.0.0.1:{dcs.metrics_port}/metrics").text


def _http_total(dcs, route: str, status: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{dcs.metrics_port}/metrics").text
    pattern = rf'^sluice_dcs_http_total\{{route="{re.escape(route)}",status="{status}"\}} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_requests_are_counted_by_route_template_and_status(dcs):
    before = {
        key: _http_total(dcs, *key)
        for key in [("unauthenticated", "401"), ("/v1/runs/{run_id}", "404"), ("/v1/topology", "200")]
    }
    httpx.get(dcs.url + "/v1/topology", headers={"authorization": "Bearer wrong"})
    httpx.get(dcs.url + "/v1/runs/nope", headers=AUTH)
    httpx.get(dcs.url + "/v1/runs/nope-either", headers=AUTH)
    httpx.get(dcs.url + "/v1/topology", headers=AUTH)
    assert _http_total(dcs, "unauthenticated", "401") == before[("unauthenticated", "401")] + 1
    assert _http_total(dcs, "/v1/runs/{run_id}", "404") == before[("/v1/runs/{run_id}", "404")] + 2
    assert _http_total(dcs, "/v1/topology", "200") == before[("/v1/topology", "200")] + 1
