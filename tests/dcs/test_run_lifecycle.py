"""A run's lifecycle on the coordinator (a real process over a real Redis): status transitions, failure
reports, stop and finish, what each refuses, and a membership released from a pause by the run's end."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.dcs.client import DCSClient, DCSError
from services.dcs.local import LocalDCS
from services.dcs.membership import RunMembership
from services.dcs.models import MAX_FAILURE_MESSAGE, Heartbeat, NodeRegistration, RunConfig


@pytest.fixture
def run_id(client, uniq):
    name = uniq("run")
    client.create_run(RunConfig(name=name, model="/models/tiny"))
    return name


def _refused(call, *args) -> DCSError:
    with pytest.raises(DCSError) as err:
        call(*args)
    assert err.value.status == 409
    return err.value


def test_pause_and_resume_move_the_status_and_a_new_run_is_running(client, run_id):
    assert client.run(run_id).status == "running" and client.status(run_id).failure is None
    assert client.pause(run_id).status == "paused"
    assert client.status(run_id).status == "paused"
    assert client.resume(run_id).status == "running"


def test_the_first_failure_wins_and_later_ones_are_kept(client, run_id):
    node = client.register(NodeRegistration(role="rollout", host="127.0.0.1", run_id=run_id))
    run = client.fail_run(run_id, "rollout", "reward import:x:y: cannot import module 'x'", node_id=node.node_id)
    assert run.status == "failed" and run.ended_at is not None
    assert (run.failure.role, run.failure.node_id) == ("rollout", node.node_id) and "import:x:y" in run.failure.message
    for i in range(12):  # later failures: the newest 10 are kept
        client.fail_run(run_id, "trainer", f"later {i}")
    status = client.status(run_id)
    assert status.status == "failed" and status.failure == run.failure  # the first one still
    assert [f.message for f in status.later_failures] == [f"later {i}" for i in range(11, 1, -1)]
    assert client.heartbeat(node.node_id, Heartbeat()).status == "failed"  # heartbeats carry it


def test_a_failed_run_refuses_pause_resume_stop_and_finish_and_stays_failed(client, run_id):
    failed = client.fail_run(run_id, "trainer", "CUDA out of memory")
    for call in (client.pause, client.resume, client.stop_run, client.finish_run):
        assert "failed" in str(_refused(call, run_id))
    assert client.run(run_id) == failed


def test_stop_is_final_and_repeatable(client, run_id):
    client.pause(run_id)
    stopped = client.stop_run(run_id)
    assert stopped.status == "stopped" and stopped.ended_at is not None
    assert client.stop_run(run_id) == stopped  # a second stop changes nothing
    assert "cannot fail" in str(_refused(client.fail_run, run_id, "rollout", "too late"))
    for call in (client.finish_run, client.pause, client.resume):
        _refused(call, run_id)
    assert client.run(run_id) == stopped and client.status(run_id).later_failures == []


def test_finish_is_final_and_a_finished_run_cannot_fail(client, run_id):
    finished = client.finish_run(run_id)
    assert finished.status == "finished"
    assert client.finish_run(run_id) == finished
    _refused(client.fail_run, run_id, "trainer", "after the end")
    _refused(client.stop_run, run_id)
    assert client.run(run_id) == finished


def test_bad_failure_reports_are_422_and_change_nothing(dcs, client, run_id):
    before = client.run(run_id)
    with httpx.Client(base_url=dcs.url) as http:
        path = f"/v1/runs/{run_id}/fail"
        for body in (
            {"message": "no role"},
            {"role": "trainer"},
            {"role": "trainer", "message": ""},
            {"role": "Trainer!", "message": "m"},
            {"role": "trainer", "message": "m", "extra": 1},
            {"role": "trainer", "message": "x" * (MAX_FAILURE_MESSAGE + 1)},
        ):
            r = http.post(path, json=body)
            assert r.status_code == 422, (body, r.text)
        r = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422
        r = http.post("/v1/runs/no-such-run/fail", json={"role": "trainer", "message": "m"})
        assert r.status_code == 404 and "no-such-run" in r.text
        for action in ("stop", "finish"):
            assert http.post(f"/v1/runs/no-such-run/{action}").status_code == 404
            assert http.post(f"/v1/runs/bad run!/{action}").status_code == 422
    assert client.run(run_id) == before


def test_the_client_cuts_a_long_message_keeping_its_end(client, run_id):
    run = client.fail_run(run_id, "trainer", "x" * 10_000 + "the cause")
    assert len(run.failure.message) == MAX_FAILURE_MESSAGE and run.failure.message.endswith("the cause")


def test_lifecycle_routes_need_the_token(tmp_path):
    with LocalDCS(log_dir=str(tmp_path), token="s3cret") as d:
        with DCSClient(d.url, token="s3cret") as c:
            c.create_run(RunConfig(name="r", model="/m"))
        with httpx.Client(base_url=d.url) as http:
            for action, body in (("fail", {"role": "trainer", "message": "m"}), ("stop", None), ("finish", None)):
                assert http.post(f"/v1/runs/r/{action}", json=body).status_code == 401, action
                wrong = {"authorization": "Bearer wrong"}
                assert http.post(f"/v1/runs/r/{action}", json=body, headers=wrong).status_code == 401, action
        with DCSClient(d.url, token="s3cret") as c:
            assert c.run("r").status == "running"  # nothing changed
            assert c.stop_run("r").status == "stopped"


def test_a_stopped_run_releases_a_role_waiting_at_a_pause(client, run_id):
    client.pause(run_id)
    membership = RunMembership(
        client, NodeRegistration(role="advantage", host="127.0.0.1", run_id=run_id), interval_s=0.1
    )
    released = threading.Event()

    def wait_at_safe_point():
        membership.safe_point()
        released.set()

    waiter = threading.Thread(target=wait_at_safe_point, daemon=True)
    try:
        waiter.start()
        deadline = time.monotonic() + 30
        while not all(s.pause_acknowledged for s in client.status(run_id).services):  # it reached the pause
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not released.is_set()  # paused: it waits
        client.stop_run(run_id)
        assert released.wait(30), "the stopped run did not release the safe point"
        assert membership.ended and not membership.paused
    finally:
        membership.close()


def test_an_ended_run_is_deleted_with_its_state_and_its_id_starts_afresh(dcs, client, run_id):
    import redis

    from services.dcs.models import WeightMetadata
    from services.run_state import run_key

    tensor = {"name": "w", "dtype": "float32", "shape": [2], "bucket": 0, "offset": 0, "nbytes": 8}
    client.publish_weights(run_id, WeightMetadata(version=1, tensors=[tensor], bucket_bytes=[8]))
    client.set_cursor(run_id, "engine", 1)
    store = redis.Redis.from_url(dcs.redis_url, decode_responses=True)
    store.set(run_key(run_id, "trainer", "progress"), "{}")  # run state a role keeps beside the coordinator's
    other = run_id + "-other"
    client.create_run(RunConfig(name=other, model="/models/tiny"))
    store.set(run_key(other, "trainer", "progress"), "{}")
    with pytest.raises(DCSError) as refused:  # still running: stop it first
        client.delete_run(run_id)
    assert refused.value.status == 409 and client.run(run_id).status == "running"
    client.stop_run(run_id)
    assert "deleted" in client.delete_run(run_id)
    with pytest.raises(DCSError) as gone:
        client.run(run_id)
    assert gone.value.status == 404
    assert store.keys(f"*{run_id}:*") == [] and store.exists(run_key(other, "trainer", "progress"))
    assert client.run(other).status == "running"  # another run is untouched
    client.create_run(RunConfig(name=run_id, model="/models/tiny"))  # the id is free, and starts from nothing
    assert client.cursors(run_id) == {}
    with pytest.raises(DCSError) as unpublished:
        client.latest_weights(run_id)
    assert unpublished.value.status == 404


def test_a_node_dead_for_the_ttl_is_dropped_from_the_topology(tmp_path):
    with (
        LocalDCS(log_dir=str(tmp_path), args=("--node-lease-s", "0.5", "--dead-node-ttl-s", "1")) as d,
        DCSClient(d.url) as c,
    ):
        gone = c.register(NodeRegistration(role="engine", host="h", run_id="x"))
        kept = c.register(NodeRegistration(role="rollout", host="h", run_id="x"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            c.heartbeat(kept.node_id, Heartbeat())
            ids = {n.node_id for ns in c.topology().roles.values() for n in ns}
            if gone.node_id not in ids:
                break
            time.sleep(0.2)
        assert gone.node_id not in ids and kept.node_id in ids
