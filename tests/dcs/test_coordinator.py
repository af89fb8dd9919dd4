"""The DCS coordinator as a real process over a real Redis."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.dcs.client import DCSClient, DCSError
from services.dcs.local import LocalDCS
from services.dcs.models import (
    Heartbeat,
    NodeRegistration,
    RunConfig,
    SyncGroupRequest,
    SyncReport,
    WeightMetadata,
    WeightTensor,
)

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker


@pytest.fixture(scope="module")
def dcs(tmp_path_factory):
    with LocalDCS(log_dir=str(tmp_path_factory.mktemp("dcs"))) as d:  # the default 10 s lease: no node of a
        yield d  # test dies while a loaded machine stalls


def _meta(version: int) -> WeightMetadata:
    return WeightMetadata(
        version=version,
        bucket_bytes=[64],
        tensors=[
            WeightTensor(name="model.embed_tokens.weight", dtype="float32", shape=[4, 4], bucket=0, offset=0, nbytes=64)
        ],
    )


def _node(c: DCSClient, role: str, run_id: str, **kw):
    return c.register(NodeRegistration(role=role, host="127.0.0.1", run_id=run_id, **kw))


def test_nodes_heartbeat_and_die_after_their_lease(tmp_path, uniq):
    with LocalDCS(log_dir=str(tmp_path), args=("--node-lease-s", "2.0")) as d, DCSClient(d.url) as client:
        _heartbeat_keeps_one_alive(client, uniq("run"))


def _heartbeat_keeps_one_alive(client: DCSClient, run: str) -> None:
    a = _node(client, "engine", run, rank=0, parallel={"tp": 2}, ports={"http": 30000})
    b = _node(client, "actor_fwd", run)
    roles = client.topology().roles
    assert a.node_id in [n.node_id for n in roles["engine"]] and roles["engine"][0].parallel == {"tp": 2}
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # keep a alive, let b's 2 s lease lapse
        client.heartbeat(a.node_id, Heartbeat(step=3))
        time.sleep(0.2)
    nodes = {n.node_id: n for ns in client.topology().roles.values() for n in ns}
    assert nodes[a.node_id].alive and nodes[a.node_id].step == 3
    assert not nodes[b.node_id].alive
    assert client.unregister(b.node_id) is True
    with pytest.raises(DCSError) as err:
        client.heartbeat(b.node_id, Heartbeat())
    assert err.value.status == 404 and b.node_id in err.value.detail


def test_weight_versions_are_monotonic_and_long_poll_wakes(client, uniq):
    run = uniq("run")
    assert client.next_weights(run, 0, 0) is None
    client.publish_weights(run, _meta(1))
    with pytest.raises(DCSError) as err:
        client.publish_weights(run, _meta(1))
    assert err.value.status == 409 and run in err.value.detail
    got = {}

    def waiter():
        with DCSClient(client.core.base_url) as c:
            t0 = time.monotonic()
            got["w"] = c.next_weights(run, 1, wait_s=20)
            got["s"] = time.monotonic() - t0

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    client.publish_weights(run, _meta(2))
    thread.join(10)
    assert got["w"].version == 2 and got["s"] < 15  # woken by the publish, not the 20 s bound
    assert client.next_weights(run, 2, wait_s=0.3) is None
    assert client.latest_weights(run).version == 2


def test_each_receiver_role_has_its_own_cursor(client, uniq):
    run = uniq("run")
    for v in range(1, 4):
        client.publish_weights(run, _meta(v))
    client.set_cursor(run, "reference", client.cursors_of(run, "reference"))  # a role declares itself at start
    client.set_cursor(run, "engine", 3)
    assert client.weights(run, 1).version == 1  # reference has not consumed it: kept
    cursors = client.set_cursor(run, "reference", 2)
    assert cursors == {"engine": 3, "reference": 2}
    with pytest.raises(DCSError) as err:
        client.weights(run, 1)  # now below every role's cursor: collected
    assert err.value.status == 404
    assert client.weights(run, 2).version == 2
    with pytest.raises(DCSError) as err:
        client.set_cursor(run, "reference", 1)  # a role cannot move backwards
    assert err.value.status == 409
    with pytest.raises(DCSError) as err:
        client.set_cursor(run, "engine", 13)
    assert err.value.status == 409


def test_runs_keep_their_own_weights_cursors_groups_and_reports(client, uniq):
    a, b = uniq("run-a"), uniq("run-b")
    for v in (1, 2, 3):
        client.publish_weights(a, _meta(v))
    client.publish_weights(b, _meta(1))  # version 1 of b is not "older than a's latest"
    assert client.latest_weights(a).version == 3 and client.latest_weights(b).version == 1
    assert client.next_weights(b, 1, wait_s=0.2) is None  # a's publishes do not answer b's long-poll
    client.set_cursor(a, "actor_fwd", 3)  # collects a's versions 1 and 2, none of b's
    assert client.cursors(a) == {"actor_fwd": 3} and client.cursors(b) == {}
    assert client.weights(b, 1).version == 1
    with pytest.raises(DCSError) as err:
        client.set_cursor(b, "actor_fwd", 3)  # b never published 3
    assert err.value.status == 409 and b in err.value.detail
    trainer_a, trainer_b = _node(client, "trainer", a), _node(client, "trainer", b)
    engine_a, engine_b = _node(client, "engine", a), _node(client, "engine", b)
    ga = client.sync_group(
        a, SyncGroupRequest(source_node=trainer_a.node_id, master_address="127.0.0.1", master_port=29501)
    )
    gb = client.sync_group(
        b, SyncGroupRequest(source_node=trainer_b.node_id, master_address="127.0.0.1", master_port=29502)
    )
    assert [m.node_id for m in ga.members] == [trainer_a.node_id, engine_a.node_id]
    assert [m.node_id for m in gb.members] == [trainer_b.node_id, engine_b.node_id] and ga.name != gb.name
    assert client.current_group(a) == ga and client.current_group(b) == gb
    with pytest.raises(DCSError) as err:  # a's trainer cannot make b's group
        client.sync_group(
            b, SyncGroupRequest(source_node=trainer_a.node_id, master_address="127.0.0.1", master_port=29503)
        )
    assert err.value.status == 409 and a in err.value.detail and b in err.value.detail
    client.report_sync(a, SyncReport(version=3, group=ga.name, node_id=trainer_a.node_id, ok=True))
    assert [r.group for r in client.sync_reports(a)] == [ga.name] and client.sync_reports(b) == []


def test_sync_group_reused_until_membership_changes(client, uniq):
    run = uniq("run")
    trainer = _node(client, "trainer", run, master_port=29500)
    e1 = _node(client, "engine", run, parallel={"tp": 2})
    e2 = _node(client, "engine", run, rank=1)
    req = SyncGroupRequest(source_node=trainer.node_id, master_address="127.0.0.1", master_port=29500)
    g1 = client.sync_group(run, req)
    assert g1.world_size == 4 and [m.rank for m in g1.members] == [0, 1, 3]
    assert client.sync_group(run, req) == g1
    assert client.current_group(run) == g1
    client.unregister(e2.node_id)  # membership change -> a new group
    g2 = client.sync_group(run, req)
    assert g2.generation > g1.generation and g2.name != g1.name and g2.world_size == 3
    assert [m.node_id for m in g2.members] == [trainer.node_id, e1.node_id]
    client.report_sync(
        run,
        SyncReport(
            version=1,
            group=g2.name,
            node_id=trainer.node_id,
            ok=True,
            seconds={"broadcast": 0.1, "total": 0.2},
            bytes=1000,
        ),
    )
    assert client.sync_reports(run, 1)[0].group == g2.name


def test_pause_resume_round_trip_with_acks(client, uniq):
    run_id = uniq("run")
    client.create_run(RunConfig(name=run_id, model="/models/tiny", max_staleness=1))
    with pytest.raises(DCSError) as err:
        client.create_run(RunConfig(name=run_id, model="/models/tiny"))
    assert err.value.status == 409
    nodes = [_node(client, role, run_id) for role in ("trainer", "rollout")]
    for n in nodes:
        assert client.heartbeat(n.node_id, Heartbeat(step=5)).desired_state == "running"
    run = client.pause(run_id)
    assert run.desired_state == "paused" and run.pause_seq == 1
    reply = client.heartbeat(nodes[0].node_id, Heartbeat(step=5, paused_seq=reply_seq(client, nodes[0])))
    assert reply.desired_state == "paused"
    status = {s.node_id: s for s in client.status(run_id).services}
    assert status[nodes[0].node_id].state == "paused" and status[nodes[0].node_id].pause_acknowledged
    assert status[nodes[1].node_id].state == "pausing" and not status[nodes[1].node_id].pause_acknowledged
    client.heartbeat(nodes[1].node_id, Heartbeat(step=6, weight_version=3, paused_seq=1))
    status = {s.node_id: s for s in client.status(run_id).services}
    assert all(s.state == "paused" for s in status.values())
    assert status[nodes[1].node_id].weight_version == 3
    assert client.resume(run_id).desired_state == "running"
    assert all(s.state == "running" for s in client.status(run_id).services)
    assert client.pause(run_id).pause_seq == 2  # a new pause needs new acks
    assert all(s.state == "pausing" for s in client.status(run_id).services)


def reply_seq(client, node) -> int:
    return client.heartbeat(node.node_id, Heartbeat()).pause_seq


def _registrations(client) -> dict:
    """Every node as registered; liveness is left out, since a lease lapses on its own."""
    return {n.node_id: n.model_dump(exclude={"alive"}) for nodes in client.topology().roles.values() for n in nodes}


def test_bad_input_is_4xx_and_changes_nothing(dcs, client):
    before = _registrations(client)
    with httpx.Client(base_url=dcs.url) as http:
        assert http.post("/v1/nodes", json={"role": "Bad Role!", "host": "h"}).status_code == 422
        assert (
            http.post("/v1/nodes", content=b"{not json", headers={"content-type": "application/json"}).status_code
            == 422
        )
        r = http.post("/v1/runs", json={"name": "x", "model": "/m", "mode": "colocate", "max_staleness": 2})
        assert r.status_code == 422 and "colocate" in r.text
        bad = _meta(10**6).model_dump()
        bad["tensors"][0]["nbytes"] = 10**9
        assert http.post("/v1/runs/r/weights", json=bad).status_code == 422
        assert http.post("/v1/runs/bad run!/weights", json=_meta(1).model_dump()).status_code == 422
        r = http.get("/v1/runs/nope/weights/latest")
        assert r.status_code == 404 and "nope" in r.text
        assert http.get("/v1/runs/nope/status").status_code == 404
    assert _registrations(client) == before


def test_coordinator_restart_loses_nothing(tmp_path):
    with LocalDCS(log_dir=str(tmp_path)) as d, DCSClient(d.url) as c:
        node = _node(c, "trainer", "r")
        c.create_run(RunConfig(name="r", model="/m"))
        c.publish_weights("r", _meta(7))
        c.set_cursor("r", "actor_fwd", 7)
        c.pause("r")
        d.proc.kill()
        d.start()
        assert c.latest_weights("r").version == 7 and c.cursors("r") == {"actor_fwd": 7}
        assert c.run("r").desired_state == "paused"
        assert c.heartbeat(node.node_id, Heartbeat(paused_seq=1)).pause_seq == 1
        assert [s.state for s in c.status("r").services] == ["paused"]


def test_token_required_on_every_endpoint_but_health(tmp_path):
    with LocalDCS(log_dir=str(tmp_path), token="s3cret") as d:
        with httpx.Client(base_url=d.url) as http:
            for path in ("/openapi.json", "/docs", "/metrics", "/v1/topology", "/v1/runs/r/weights/latest", "/v1/runs"):
                assert http.get(path).status_code == 401, path
            assert http.post("/v1/nodes", json={"role": "trainer", "host": "h"}).status_code == 401
            assert http.get("/healthz").status_code == 200 and http.get("/readyz").status_code == 200
            assert http.get("/v1/topology", headers={"authorization": "Bearer wrong"}).status_code == 401
        with DCSClient(d.url, token="s3cret") as c:
            assert c.topology().roles == {}
        assert d.proc.stop() == 0  # SIGTERM: clean exit
        assert '"msg": "dcs stopped"' in d.proc.log_tail()


def test_a_sync_group_leaves_out_the_receivers_the_source_excludes(client, uniq):
    """An engine the trainer found unresponsive (alive as far as the coordinator knows: the rollout
    registers and heartbeats it) is left out of the group while excluded, and is back once it is not."""
    run = uniq("run")
    trainer = _node(client, "trainer", run, master_port=29500)
    e1, e2 = _node(client, "engine", run), _node(client, "engine", run, rank=1)
    req = SyncGroupRequest(source_node=trainer.node_id, master_address="127.0.0.1", master_port=29500)
    whole = client.sync_group(run, req)
    without = client.sync_group(run, req.model_copy(update={"exclude_nodes": [e2.node_id]}))
    assert [m.node_id for m in without.members] == [trainer.node_id, e1.node_id] and without.world_size == 2
    assert without.name != whole.name
    again = client.sync_group(run, req)
    assert [m.node_id for m in again.members] == [trainer.node_id, e1.node_id, e2.node_id]
