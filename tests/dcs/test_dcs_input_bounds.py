"""The coordinator against bad numbers, as a real process: non-finite floats (which Python's JSON reads),
integers past every sane bound and out-of-range ports get 422 naming the field, never echo the input, and
change nothing; a body over the cap gets 413."""

from __future__ import annotations

import json

import httpx
import pytest

from services.dcs.local import LocalDCS

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

RUN = {
    "name": "r",
    "model": "/m",
    "n_samples_per_prompt": 2,
    "rollout_batch_size": 2,
    "global_batch_size": 4,
    "micro_batch_size": 2,
}
MARK = 987654321987654321987654321  # a number whose digits would show if the input were echoed


@pytest.fixture(scope="module")
def dcs(tmp_path_factory):
    with LocalDCS(log_dir=str(tmp_path_factory.mktemp("dcs-bounds"))) as d:
        yield d.url


def _post(url: str, body) -> httpx.Response:
    # json.dumps writes NaN and Infinity as Python's parser reads them
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize(
    "change",
    [
        {"optim": {"lr": float("inf")}},
        {"algorithm": {"kl_coef": float("nan")}},
        {"num_steps": MARK},
        {"optim": {"seed": -1}},
        {"optim": {"betas": [0.9, 1.0]}},
        {"rollout": {"temperature": float("-inf")}},
        {"checkpoint": {"interval": MARK}},
        {"rollout_batch_size": MARK},
    ],
)
def test_a_run_with_a_bad_number_is_refused_and_not_created(dcs, change):
    r = _post(dcs + "/v1/runs", {**RUN, **change})
    assert r.status_code == 422, r.text
    assert str(MARK) not in r.text and "input" not in r.json()["detail"][0]
    assert r.json()["detail"][0]["loc"][:2] == ["body", next(iter(change))]
    assert httpx.get(dcs + "/v1/runs").json() == []


def test_node_weight_and_cursor_numbers_are_bounded(dcs):
    assert _post(dcs + "/v1/runs", RUN).status_code == 201
    bad_node = {"role": "engine", "host": "h", "ports": {"http": 70000}, "run_id": "r"}
    assert _post(dcs + "/v1/nodes", bad_node).status_code == 422
    node = _post(dcs + "/v1/nodes", {**bad_node, "ports": {"http": 7000}}).json()["node_id"]
    for beat in ({"weight_version": MARK}, {"step": 1 << 63}, {"paused_seq": -1}):
        r = _post(f"{dcs}/v1/nodes/{node}/heartbeat", beat)
        assert r.status_code == 422 and str(MARK) not in r.text, beat
    tensor = {"name": "w", "dtype": "float32", "shape": [2], "bucket": 0, "offset": 0, "nbytes": 8}
    for meta in (
        {"version": MARK, "tensors": [tensor], "bucket_bytes": [8]},
        {"version": 1, "tensors": [{**tensor, "shape": [MARK]}], "bucket_bytes": [8]},
        {"version": 1, "tensors": [tensor], "bucket_bytes": [1 << 60]},
    ):
        assert _post(dcs + "/v1/runs/r/weights", meta).status_code == 422
    assert httpx.get(dcs + "/v1/runs/r/weights/latest").status_code == 404  # nothing was published
    r = httpx.put(
        dcs + "/v1/runs/r/cursors/engine",
        content=json.dumps({"version": float("nan")}),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422
    assert httpx.get(dcs + "/v1/runs/r/cursors").json() == {"cursors": {}}


def test_a_body_over_the_cap_is_refused_before_it_is_read(dcs):
    """A declared 65 MiB body: 413 comes back with not one byte of it sent (a raw socket: an HTTP client
    will not declare a length it does not send)."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(dcs)
    before = httpx.get(dcs + "/v1/runs").json()
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (65 << 20)
        )
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"413"
    assert httpx.get(dcs + "/v1/runs").json() == before
