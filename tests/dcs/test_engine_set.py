"""A run's engine set on the coordinator (a real process over a real Redis): engines added over REST, engines that
register themselves, removal that keeps a removed engine out, and the membership of a removed engine."""

from __future__ import annotations

import time

import httpx
import pytest

from services.dcs.client import DCSClient, DCSError
from services.dcs.local import LocalDCS
from services.dcs.membership import RunMembership
from services.dcs.models import Heartbeat, NodeRegistration, RunConfig


def _run(client: DCSClient, name: str) -> None:
    client.create_run(
        RunConfig(
            name=name,
            model="/m",
            n_samples_per_prompt=2,
            rollout_batch_size=1,
            global_batch_size=2,
            micro_batch_size=2,
            rollout={"prompts": "demo:arith"},
        )
    )


def _engine(client: DCSClient, run: str, port: int, **kw):
    return client.register(NodeRegistration(role="engine", host="127.0.0.1", run_id=run, ports={"http": port}, **kw))


def test_added_engines_are_listed_once_in_order_and_removal_keeps_them_out(client, uniq):
    run = uniq("run")
    _run(client, run)
    first = client.add_engine(run, "http://LOCALHOST:31001/")
    assert (first.url, first.source, first.node_id, first.alive) == ("http://localhost:31001", "added", None, False)
    assert client.add_engine(run, "http://localhost:31001").rank == first.rank  # adding again changes nothing
    second = client.add_engine(run, "https://127.0.0.1")
    assert second.url == "https://127.0.0.1:443" and second.rank > first.rank
    own = _engine(client, run, 31003, weights_dtype="bfloat16", weight_version=4)  # one that registers itself
    client.heartbeat(own.node_id, Heartbeat())
    listing = client.engines(run)
    assert [(e.url, e.source) for e in listing.engines] == [
        ("http://localhost:31001", "added"),
        ("https://127.0.0.1:443", "added"),
        ("http://127.0.0.1:31003", "self"),
    ]
    assert listing.engines[2].alive and listing.engines[2].weight_version == 4

    message = client.remove_engine(run, "http://127.0.0.1:31003")
    assert "1 registration" in message
    assert [e.url for e in client.engines(run).engines] == ["http://localhost:31001", "https://127.0.0.1:443"]
    assert client.engines(run).removed == ["http://127.0.0.1:31003"]
    with pytest.raises(DCSError) as err:  # it cannot slip back in
        _engine(client, run, 31003)
    assert err.value.status == 409 and "sluice engines add" in err.value.detail
    with pytest.raises(DCSError) as err:  # nor through the rollout's own --engine-url list
        client.add_engine(run, "http://127.0.0.1:31003", initial=True)
    assert err.value.status == 409
    client.add_engine(run, "http://127.0.0.1:31003")  # an operator's add brings it back
    assert _engine(client, run, 31003).node_id
    assert client.engines(run).removed == []
    other = uniq("run")  # removal is per run
    _run(client, other)
    assert _engine(client, other, 31001).run_id == other


def test_bad_engine_requests_are_4xx_and_change_nothing(dcs, client, uniq):
    run = uniq("run")
    _run(client, run)
    headers = {"authorization": f"Bearer {client.token}"} if client.token else {}
    for body in (
        {"url": "ftp://h:1"},
        {"url": "http://h:1/path"},
        {"url": "http://user:pw@h:1"},
        {"url": "http://h:99999"},
        {"url": ""},
        {"url": "http://h:1", "extra": 1},
    ):
        r = httpx.post(f"{dcs.url}/v1/runs/{run}/engines", json=body, headers=headers)
        assert r.status_code == 422, (body, r.text)
    r = httpx.delete(f"{dcs.url}/v1/runs/{run}/engines", params={"url": "nope://x"}, headers=headers)
    assert r.status_code == 422 and "scheme" in r.text
    for call in (
        lambda: client.add_engine("no-such-run", "http://h:1"),
        lambda: client.engines("no-such-run"),
        lambda: client.remove_engine(run, "http://h:1"),
    ):
        with pytest.raises(DCSError) as err:
            call()
        assert err.value.status == 404
    assert client.engines(run).engines == [] and client.engines(run).removed == []


def test_a_removed_engines_membership_stops_instead_of_registering_again(tmp_path, uniq):
    with LocalDCS(log_dir=str(tmp_path)) as d, DCSClient(d.url) as client:
        run = uniq("run")
        _run(client, run)
        client.add_engine(run, "http://127.0.0.1:31005")
        membership = RunMembership(
            client, NodeRegistration(role="engine", host="127.0.0.1", run_id=run, ports={"http": 31005}), interval_s=0.1
        )
        try:
            assert client.engines(run).engines[0].alive
            client.remove_engine(run, "http://127.0.0.1:31005")
            deadline = time.monotonic() + 10
            while not membership.removed and time.monotonic() < deadline:
                time.sleep(0.05)
            assert membership.removed
            assert "engine" not in client.topology().roles or all(
                n.run_id != run for n in client.topology().roles["engine"]
            )
        finally:
            membership.close()
