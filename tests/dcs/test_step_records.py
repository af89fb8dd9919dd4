"""The trainer's steps on the coordinator (a real process over a real Redis): reported through the client
(`POST /v1/runs/<run>/steps`), read back a page at a time (`GET`), kept under the coordinator's own run key, and
deleted with the run."""

from __future__ import annotations

import httpx
import pytest
import redis

from services.dcs.client import DCSError
from services.dcs.models import RunConfig, StepRecord, StepsReport


@pytest.fixture
def run_id(client, uniq):
    name = uniq("steps")
    client.create_run(RunConfig(name=name, model="/models/tiny"))
    return name


def _report(next_step: int, version: int, *steps: int) -> StepsReport:
    records = [StepRecord(step=s, metrics={"reward_mean": s / 10, "staleness": {"0": 4}}) for s in steps]
    return StepsReport(next_step=next_step, weight_version=version, steps=records)


def test_reported_steps_are_read_back_a_page_at_a_time(client, run_id):
    page = client.steps(run_id)
    assert (page.next_step, page.weight_version, page.steps) == (0, 0, [])  # nothing reported yet
    client.report_steps(run_id, _report(2, 2, 0, 1))
    client.report_steps(run_id, _report(5, 6, 2, 3, 4))
    page = client.steps(run_id)
    assert (page.next_step, page.weight_version) == (5, 6)
    assert [(r.step, r.metrics) for r in page.steps] == [
        (s, {"reward_mean": s / 10, "staleness": {"0": 4}}) for s in range(5)
    ]
    assert [r.step for r in client.steps(run_id, first=1, limit=2).steps] == [1, 2]
    assert [r.step for r in client.steps(run_id, first=4, limit=10).steps] == [4]
    assert client.steps(run_id, first=9).steps == []


def test_a_step_reported_again_replaces_its_record_and_a_step_past_the_progress_is_hidden(client, run_id):
    client.report_steps(run_id, _report(3, 3, 0, 1, 2))
    again = StepRecord(step=2, metrics={"reward_mean": 0.9, "loss": float("nan")})  # NaN is sent as null
    client.report_steps(run_id, StepsReport(next_step=3, weight_version=3, steps=[again]))
    assert client.steps(run_id, first=2).steps == [StepRecord(step=2, metrics={"reward_mean": 0.9, "loss": None})]
    # a trainer resumed from a checkpoint before step 2 reports its position: step 2 is not finished (yet)
    client.report_steps(run_id, StepsReport(next_step=2, weight_version=4))
    page = client.steps(run_id)
    assert (page.next_step, page.weight_version, [r.step for r in page.steps]) == (2, 4, [0, 1])


def test_a_report_that_is_wrong_is_refused_with_a_message_and_keeps_nothing(dcs, client, run_id):
    store = redis.Redis.from_url(dcs.redis_url, decode_responses=True)
    before = sorted(store.keys(f"*{run_id}*"))
    url = f"{dcs.url}/v1/runs/{run_id}/steps"
    unfinished = {"next_step": 1, "weight_version": 1, "steps": [{"step": 1, "metrics": {}}]}
    answer = httpx.post(url, json=unfinished)
    assert answer.status_code == 422 and "steps [1] are not finished: next_step is 1" in answer.text
    for body in (
        {"next_step": -1, "weight_version": 0},
        {"next_step": 1},
        {"next_step": 1, "weight_version": 0, "x": 1},
    ):
        assert httpx.post(url, json=body).status_code == 422, body
    with pytest.raises(DCSError) as missing:
        client.report_steps(run_id + "-none", _report(1, 1, 0))
    assert missing.value.status == 404 and "does not exist" in str(missing.value.detail)
    with pytest.raises(DCSError) as unknown:
        client.steps(run_id + "-none")
    assert unknown.value.status == 404
    assert sorted(store.keys(f"*{run_id}*")) == before


def test_the_steps_are_the_coordinators_own_keys_and_go_with_the_run(dcs, client, run_id):
    client.report_steps(run_id, _report(1, 1, 0))
    store = redis.Redis.from_url(dcs.redis_url, decode_responses=True)
    assert set(store.keys(f"dcs:run:{run_id}:*")) == {f"dcs:run:{run_id}:steps", f"dcs:run:{run_id}:progress"}
    assert store.keys(f"sluice:{run_id}:*") == []  # nothing of the roles' namespace
    client.stop_run(run_id)
    client.delete_run(run_id)
    assert store.keys(f"*{run_id}*") == []
    client.create_run(RunConfig(name=run_id, model="/models/tiny"))  # the id starts from nothing
    assert client.steps(run_id).next_step == 0 and client.steps(run_id).steps == []
