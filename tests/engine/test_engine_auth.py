"""The engine's authentication, against real engine processes: with a token, every route but /health answers
401 to a missing or wrong token and changes nothing, and works with the right one; the token is not in the
process's command line; without a token, weight updates are refused (403) unless explicitly allowed; a
separately bound metrics port serves /metrics without the token."""

from __future__ import annotations

import httpx
import pytest

from services.runtime.processes import free_port
from tests.engine.conftest import start_engine

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

TOKEN = "engine-s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory):
    metrics_port = free_port()
    proc, url = start_engine(
        tiny_model_dir, tmp_path_factory.mktemp("engine-auth"), "--metrics-port", str(metrics_port), token=TOKEN
    )
    yield proc, url, metrics_port
    proc.stop()


def every_route(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(url + "/openapi.json", headers=AUTH).json()
    return [(method.upper(), path) for path, ops in spec["paths"].items() for method in ops]


def test_every_route_but_health_refuses_a_missing_or_wrong_token_and_changes_nothing(secured):
    _, url, _ = secured
    routes = every_route(url)
    for needed in (
        "/generate",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/metrics",
        "/spans",
        "/pause_generation",
        "/weight_version",
    ):
        assert any(path == needed for _, path in routes), needed
    for method, path in routes + [("GET", "/docs"), ("GET", "/openapi.json")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            r = httpx.request(
                method, url + path, headers=headers, timeout=30, json={"mode": "abort"} if method == "POST" else None
            )
            expected = 200 if path == "/health" else 401
            assert r.status_code == expected, (method, path, headers, r.text)
    # the refused pause and weight-update calls left the engine serving its initial weights
    assert httpx.get(url + "/weight_version", headers=AUTH).json() == {"weight_version": "default"}
    r = httpx.post(url + "/generate", json=GENERATE, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_the_right_token_is_served_and_is_not_on_the_command_line(secured):
    proc, url, _ = secured
    assert httpx.get(url + "/model_info", headers=AUTH).json()["is_generation"] is True
    assert "sluice_engine_steps" in httpx.get(url + "/metrics", headers=AUTH).text
    with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as f:
        assert TOKEN.encode() not in f.read()


def test_a_separate_metrics_port_serves_only_metrics_without_the_token(secured):
    _, _, metrics_port = secured
    assert "sluice_engine_steps" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text


def test_without_a_token_weight_updates_are_refused_unless_allowed(tiny_model_dir, tmp_path):
    proc, url = start_engine(tiny_model_dir, tmp_path, open_weight_updates=False)
    try:
        for path in (
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/begin_weight_update",
            "/end_weight_update",
            "/destroy_weights_update_group",
            "/update_weights_from_tensor",
            "/update_weights_from_disk",
            "/update_weight_version",
            "/release_memory_occupation",
            "/resume_memory_occupation",
        ):
            r = httpx.post(url + path, json={})
            assert r.status_code == 403, (path, r.text)
            assert "--allow-unauthenticated-weight-updates" in r.json()["error"]["message"]
        assert httpx.post(url + "/generate", json=GENERATE, timeout=60).status_code == 200  # the rest stays open
        assert httpx.get(url + "/weight_version").json() == {"weight_version": "default"}
    finally:
        proc.stop()
    proc, url = start_engine(tiny_model_dir, tmp_path)  # --allow-unauthenticated-weight-updates
    try:
        r = httpx.post(url + "/end_weight_update")
        assert r.status_code == 200, r.text
        assert "UNAUTHENTICATED WEIGHT UPDATES ALLOWED" in proc.log_tail(20000)
    finally:
        proc.stop()
